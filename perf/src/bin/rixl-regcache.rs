//! `rixl-regcache`: register/release cycles of the same caller-owned range, with and without the
//! registration cache, through `Agent::register_host` and `Registration::release`.
//!
//! - **cached**: one registration of the range stays live (the engine's pool, registered once);
//!   each cycle registers the same range again (reusing its memory region) and releases it.
//! - **uncached**: nothing else is live, so each cycle's registration pins the pages
//!   (`ibv_reg_mr`) and its release deregisters them.
//!
//! ```text
//! rixl-regcache --size 1G --cycles 10000 --uncached-cycles 20
//! ```
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures_lite::future::block_on;
use hdrhistogram::Histogram;
use rixl::agent::{Agent, AgentConfig, Visibility};
use rixl::verbs::memmap2::MmapMut;
use rixl::verbs::HostBuffer;

#[derive(Parser, Debug)]
#[command(about = "register/release cycles of one range, with and without the registration cache")]
struct Args {
    /// Bytes in the range (suffixes K, M, G).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: usize,
    /// Cycles with the cache (a live registration of the range).
    #[arg(long, default_value_t = 10_000)]
    cycles: u64,
    /// Cycles without it (each pins and unpins the pages).
    #[arg(long, default_value_t = 20)]
    uncached_cycles: u64,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mul)
        .map_err(|e| format!("size {s:?}: {e}"))
}

struct Run {
    per_cycle: Histogram<u64>,
    total: Duration,
}

/// `cycles` register/release cycles of all of `mem`.
fn cycles(agent: &Agent, mem: &Arc<HostBuffer>, cycles: u64) -> Result<Run, String> {
    let mut per_cycle = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    for _ in 0..cycles {
        let t = Instant::now();
        let view = HostBuffer::slice_of(mem, 0, mem.len()).map_err(|e| e.to_string())?;
        let reg =
            block_on(agent.register_host(view, Visibility::All)).map_err(|e| e.to_string())?;
        block_on(reg.release());
        per_cycle
            .record(t.elapsed().as_nanos() as u64)
            .map_err(|e| e.to_string())?;
    }
    Ok(Run {
        per_cycle,
        total: t0.elapsed(),
    })
}

fn line(name: &str, n: u64, r: &Run) -> String {
    let us = |q: f64| r.per_cycle.value_at_quantile(q) as f64 / 1e3;
    format!(
        "{name:>8}: {n:>6} cycles in {:>9.3} s: median {:>10.2} us, p99 {:>10.2} us per register+release",
        r.total.as_secs_f64(),
        us(0.5),
        us(0.99)
    )
}

fn main() -> Result<(), String> {
    let args = Args::parse();
    let agent = Agent::new(
        "regcache",
        AgentConfig::default().with_cluster_key(
            rixl::agent::ClusterKey::env_or_process_local().map_err(|e| e.to_string())?,
        ),
    )
    .map_err(|e| e.to_string())?;
    if !agent.has_nic() {
        return Err(
            "no RDMA device: run it in the rxe guest (perf/benches/registration-cache)".into(),
        );
    }
    let mut map = MmapMut::map_anon(args.size).map_err(|e| e.to_string())?;
    // Touch every page, so neither run pays the first faults.
    for page in map.chunks_mut(4096) {
        page[0] = 1;
    }
    let mem = Arc::new(HostBuffer::from_mmap(map).map_err(|e| e.to_string())?);
    let uncached = cycles(&agent, &mem, args.uncached_cycles)?;
    let before = agent.registration_counters();
    let pool = HostBuffer::slice_of(&mem, 0, mem.len()).map_err(|e| e.to_string())?;
    let live = block_on(agent.register_host(pool, Visibility::All)).map_err(|e| e.to_string())?;
    let cached = cycles(&agent, &mem, args.cycles)?;
    let after = agent.registration_counters();
    block_on(live.release());
    println!(
        "registration cache: {} MiB range, caller-owned (an anonymous map)",
        args.size >> 20
    );
    println!("{}", line("uncached", args.uncached_cycles, &uncached));
    println!("{}", line("cached", args.cycles, &cached));
    let mean = |r: &Run, n: u64| r.total.as_secs_f64() / n.max(1) as f64;
    println!(
        "speedup (mean per cycle): {:.0}x; cached run: {} MRs made, {} reused",
        mean(&uncached, args.uncached_cycles) / mean(&cached, args.cycles),
        after.made - before.made,
        after.reused - before.reused
    );
    agent.shutdown();
    Ok(())
}
