//! RL weight streaming with the agent API: one learner publishes new weight versions, several
//! actors pull each version as soon as they are notified.
//!
//! The learner registers its weights and serves metadata on a side channel. Each actor fetches the
//! metadata, prepares one READ request for the whole weight region (1 MiB descriptors; NIXL's
//! `createXferReq`), says "ready" (a notification), and then for every "version N" notification
//! posts that request again, verifies the weights and answers "got N".
//!
//! ```text
//! weight_stream learner --listen 0.0.0.0:7100 --actors 2 [--versions 3] [--mib 32]
//! weight_stream actor   --learner HOST:7100 --name actor-0 [--versions 3] [--mib 32]
//! ```

use std::collections::HashSet;
use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use futures_lite::StreamExt;
use rixl::agent::{Agent, AgentConfig, RemoteRef, Visibility};
use rixl::runtime::{LocalDescList, Op};

use clap::Parser;

type BoxError = Box<dyn std::error::Error>;
const CHUNK: u64 = 1 << 20;

/// Weight byte `i` of version `v`.
fn weight(v: u64, i: u64) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ (v as u8).wrapping_mul(37)
}

/// `weight_stream learner|actor [flags]`.
#[derive(Debug, Parser)]
#[command(
    about = "RL weight streaming with the agent API: a learner publishes weight versions, actors pull them"
)]
enum Cli {
    /// Publish new weight versions and wait until every actor has pulled each one
    Learner {
        /// Side-channel address to listen on
        #[arg(long, default_value = "127.0.0.1:7100")]
        listen: String,
        /// Actors to wait for
        #[arg(long, default_value_t = 2)]
        actors: u64,
        #[command(flatten)]
        common: Common,
    },
    /// Pull every version as soon as it is announced and verify it
    Actor {
        /// The learner's side-channel address
        #[arg(long, default_value = "127.0.0.1:7100")]
        learner: String,
        /// This actor's agent name
        #[arg(long, default_value = "actor-0")]
        name: String,
        /// The learner's weight region id
        #[arg(long, default_value_t = 1)]
        region: u64,
        #[command(flatten)]
        common: Common,
    },
}

/// The flags both sides take (the same values on both).
#[derive(Debug, clap::Args)]
struct Common {
    /// Weight versions
    #[arg(long, default_value_t = 3)]
    versions: u64,
    /// MiB of weights
    #[arg(long, default_value_t = 32)]
    mib: u64,
}

fn learner(listen: &str, actors: u64, versions: u64, bytes: u64) -> Result<(), BoxError> {
    let agent = Agent::new("learner", AgentConfig::default())?;
    let w = block_on(agent.register(bytes as usize, Visibility::All))?;
    let addr = agent.listen(listen)?;
    println!(
        "learner: {} MiB of weights (region {}), side channel {addr}, waiting for {actors} actors",
        bytes >> 20,
        w.id()
    );
    let mut notifs = agent.notifications().ok_or("stream taken")?;
    let mut ready = HashSet::new();
    while (ready.len() as u64) < actors {
        let (peer, msg) = block_on(notifs.next()).ok_or("stream ended")?;
        if msg == b"ready" {
            ready.insert(peer);
        }
    }
    let mut buf = vec![0u8; CHUNK as usize];
    for v in 1..=versions {
        // A training step produced new weights: write them in place, then announce the version.
        for c in 0..bytes / CHUNK {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = weight(v, c * CHUNK + i as u64);
            }
            w.region().write_at(c * CHUNK, &buf)?;
        }
        let t = Instant::now();
        for a in &ready {
            block_on(agent.notify(a, format!("version {v}").as_bytes()))?;
        }
        let mut got = HashSet::new();
        while got.len() < ready.len() {
            let (peer, msg) = block_on(notifs.next()).ok_or("stream ended")?;
            if msg == format!("got {v}").as_bytes() {
                got.insert(peer);
            }
        }
        println!(
            "learner: version {v} pulled and verified by {} actors in {:?}",
            got.len(),
            t.elapsed()
        );
    }
    agent.shutdown();
    Ok(())
}

fn actor(
    learner: &str,
    name: &str,
    region: u64,
    versions: u64,
    bytes: u64,
) -> Result<(), BoxError> {
    let agent = Agent::new(name, AgentConfig::default())?;
    let t0 = Instant::now();
    let peer = loop {
        match agent.fetch_remote_metadata(learner) {
            Ok(p) => break p,
            Err(_) if t0.elapsed() < Duration::from_secs(60) => {
                std::thread::sleep(Duration::from_millis(200))
            }
            Err(e) => return Err(e.into()),
        }
    };
    let local = block_on(agent.register(bytes as usize, Visibility::All))?;
    let mut list = LocalDescList::new();
    let mut remote = Vec::new();
    for c in 0..bytes / CHUNK {
        list.push(local.region(), c * CHUNK, CHUNK);
        remote.push(RemoteRef {
            region,
            offset: c * CHUNK,
            len: CHUNK,
        });
    }
    // Checked, resolved and planned once; every version only posts it.
    let pull = block_on(agent.prepare_request(&peer, Op::Read, &list, &remote))?;
    let mut notifs = agent.notifications().ok_or("stream taken")?;
    block_on(agent.notify(&peer, b"ready"))?;
    let mut buf = vec![0u8; CHUNK as usize];
    for _ in 0..versions {
        let (_, msg) = block_on(notifs.next()).ok_or("stream ended")?;
        let text = String::from_utf8(msg)?;
        let v: u64 = text
            .strip_prefix("version ")
            .ok_or("unexpected notification")?
            .parse()?;
        let t = Instant::now();
        block_on(agent.post_request(&pull, None))?;
        let took = t.elapsed();
        for c in 0..bytes / CHUNK {
            local.region().read_at(c * CHUNK, &mut buf)?;
            if buf
                .iter()
                .enumerate()
                .any(|(i, &b)| b != weight(v, c * CHUNK + i as u64))
            {
                return Err(format!("{name}: version {v} chunk {c} differs").into());
            }
        }
        block_on(agent.notify(&peer, format!("got {v}").as_bytes()))?;
        println!(
            "{name}: pulled version {v} ({} MiB) in {took:?} ({:.1} MiB/s), verified",
            bytes >> 20,
            (bytes >> 20) as f64 / took.as_secs_f64()
        );
    }
    agent.shutdown();
    Ok(())
}

fn main() -> Result<(), BoxError> {
    match Cli::parse() {
        Cli::Learner {
            listen,
            actors,
            common,
        } => learner(&listen, actors, common.versions, common.mib * CHUNK),
        Cli::Actor {
            learner,
            name,
            region,
            common,
        } => actor(&learner, &name, region, common.versions, common.mib * CHUNK),
    }
}
