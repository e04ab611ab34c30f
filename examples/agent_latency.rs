//! Latency of agent calls made from a thread that is not the engine's, as a serving engine makes
//! them: every call crosses to the engine's core (`EngineHandle`) and back. Sequential READs of
//! one size from a second agent in the same process, optionally with background readers that
//! keep other transfers in flight; prints the median, 99th percentile and maximum, and how many
//! calls took over 10 ms. With `--on-core`, the measured loop runs as a task on the reading
//! agent's engine core (`Agent::run_on_core`), where calls start without the hand-off.
//!
//! ```text
//! agent_latency [--size 4096] [--iters 2000] [--background 1] [--on-core] [--reply-spin-us N]
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, RemoteRef, Visibility};
use rixl::runtime::LocalDescList;

type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, Parser)]
#[command(about = "Latency of cross-thread agent READs")]
struct Args {
    /// Bytes per READ.
    #[arg(long, default_value_t = 4096)]
    size: u64,
    /// Measured READs.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Background threads reading all the time (other transfers in flight).
    #[arg(long, default_value_t = 1)]
    background: usize,
    /// Run the measured loop on the reading agent's engine core (no hand-off per call).
    #[arg(long)]
    on_core: bool,
    /// µs a calling thread polls for a reply before it waits (`EngineConfig::reply_spin`;
    /// the engine's default when not given).
    #[arg(long)]
    reply_spin_us: Option<u64>,
}

/// What the measured loop saw.
struct Measured {
    hist: hdrhistogram::Histogram<u64>,
    over_10ms: usize,
}

/// `iters` sequential READs of `size` bytes at slot 0, each timed.
async fn measure(
    user: Agent,
    peer: String,
    dst: rixl::runtime::Region,
    src: u64,
    size: u64,
    iters: usize,
) -> Result<Measured, String> {
    let mut hist = hdrhistogram::Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
    let mut over_10ms = 0;
    let mut l = LocalDescList::new();
    l.push(&dst, 0, size);
    let r = [RemoteRef {
        region: src,
        offset: 0,
        len: size,
    }];
    for _ in 0..iters {
        let t = Instant::now();
        user.read(&peer, &l, &r).await.map_err(|e| e.to_string())?;
        let took = t.elapsed();
        over_10ms += usize::from(took > Duration::from_millis(10));
        hist.record(took.as_micros() as u64)
            .map_err(|e| e.to_string())?;
    }
    Ok(Measured { hist, over_10ms })
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    // Both agents live in this process: one key generated here serves them (or the
    // environment's RIXL_CLUSTER_KEY).
    let key = rixl::agent::ClusterKey::env_or_process_local()?;
    let mk = |cpu: usize| {
        let mut cfg = AgentConfig::default().with_cluster_key(key.clone());
        cfg.cpu = rixl::runtime::cpu_at(cpu);
        if let Some(us) = args.reply_spin_us {
            cfg.engine.reply_spin = Duration::from_micros(us);
        }
        cfg
    };
    let owner = Agent::new("lat-owner", mk(1))?;
    let user = Agent::new("lat-user", mk(0))?;
    owner.listen("127.0.0.1:0")?;
    let len = (args.size as usize) * (args.background + 1);
    let src = block_on(owner.register(len, Visibility::All))?;
    let dst = block_on(user.register(len, Visibility::All))?;
    let peer = user.load_remote_metadata(&owner.local_metadata("lat-user")?)?;
    let read = |slot: u64| {
        let mut l = LocalDescList::new();
        l.push(dst.region(), slot * args.size, args.size);
        let r = [RemoteRef {
            region: src.id(),
            offset: slot * args.size,
            len: args.size,
        }];
        block_on(user.read(&peer, &l, &r))
    };
    // Connect and warm up.
    for _ in 0..200 {
        read(0)?;
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    let t0 = Instant::now();
    let m = std::thread::scope(|s| -> Result<Measured, BoxError> {
        for b in 0..args.background {
            let (stop, read) = (&stop, &read);
            s.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if read(b as u64 + 1).is_err() {
                        return;
                    }
                }
            });
        }
        let (u, p, d, id) = (user.clone(), peer.clone(), dst.region().clone(), src.id());
        let (size, iters) = (args.size, args.iters);
        let r = if args.on_core {
            block_on(user.run_on_core(0, move || measure(u, p, d, id, size, iters)))
                .map_err(BoxError::from)
                .and_then(|r| r.map_err(BoxError::from))
        } else {
            block_on(measure(u, p, d, id, size, iters)).map_err(BoxError::from)
        };
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        r
    })?;
    // How the reading engine waited: parks (progress task idle), CQ event waits, empty polls.
    for (rail, c) in block_on(user.rail_counters()).iter().enumerate() {
        eprintln!(
            "rail {rail}: {} completions, {} polls ({} empty), {} parks, {} event waits",
            c.completions, c.polls, c.empty_polls, c.parks, c.event_waits
        );
    }
    println!(
        "agent_latency: {} B READ x {} ({} background readers{}) in {:.2} s: p50 {} us, p99 {} us, max {} us, {} over 10 ms",
        args.size,
        args.iters,
        args.background,
        if args.on_core { ", on the engine core" } else { "" },
        t0.elapsed().as_secs_f64(),
        m.hist.value_at_quantile(0.5),
        m.hist.value_at_quantile(0.99),
        m.hist.max(),
        m.over_10ms
    );
    user.shutdown();
    owner.shutdown();
    Ok(())
}
