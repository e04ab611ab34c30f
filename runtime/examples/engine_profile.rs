//! Measures two engine properties on a real device (run in the rxe guest):
//! descriptors per second submitted for a 100 000-descriptor scattered list, and the CPU an idle
//! engine uses over 10 s, in busy and in event poll mode. Two engines in one process, connected to
//! each other through the device.
//!
//! ```text
//! scripts/rxe-guest run -- target/release/examples/engine_profile [--idle-secs 10]
//! ```

use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use rixl_runtime::{
    EngineConfig, EnginePool, LocalDescList, PollMode, RemoteDesc, RemoteDescList,
    DEFAULT_IO_MEMORY,
};

type BoxError = Box<dyn std::error::Error>;

/// User + system CPU seconds of this process (from /proc/self/stat; USER_HZ is 100 on Linux).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    // Fields after the command, by position: state(3) ... utime(14) stime(15).
    let f: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| {
        f.get(n - 3)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    (field(14) + field(15)) as f64 / 100.0
}

fn run(mode: PollMode, idle: Duration) -> Result<(), BoxError> {
    let mut cfg = EngineConfig::from_env();
    cfg.poll_mode = mode;
    cfg.timing = true;
    let cpus = vec![rixl_runtime::cpu_at(0), rixl_runtime::cpu_at(1)];
    let pool = EnginePool::start(&cfg, &cpus, DEFAULT_IO_MEMORY)?;
    let (a, b) = (&pool.handles()[0], &pool.handles()[1]);
    let (ca, ea) = block_on(a.prepare_connection())?;
    let (cb, eb) = block_on(b.prepare_connection())?;
    block_on(a.complete_connection(ca, eb))?;
    block_on(b.complete_connection(cb, ea))?;
    const N: u64 = 100_000;
    let src = block_on(a.register(64 << 20))?;
    let dst = block_on(b.register(64 << 20))?;
    let mut local = LocalDescList::with_capacity(N as usize);
    let mut remote = Vec::with_capacity(N as usize);
    for i in 0..N {
        local.push(&src, ((i * 7919 + 3) % 131_072) * 512, 256);
        remote.push(RemoteDesc {
            addr: dst.addr() + ((i * 104_729 + 13) % 131_072) * 512,
            len: 256,
            rkey: dst.rkey(),
        });
    }
    let remote = RemoteDescList(remote);
    let t = Instant::now();
    let busy_cpu0 = cpu_seconds();
    let st = block_on(a.write(ca, local.clone(), remote.clone()))?;
    let wall = t.elapsed();
    let busy_cpu = cpu_seconds() - busy_cpu0;
    println!(
        "{mode:?}: 100000 scattered 256 B descriptors: prepare {:?} ({:.2} M descriptors/s validated+planned), \
         post {:?}, total {:?} ({:.0} descriptors/s end to end, {} WRs, {} doorbells); process CPU during it {busy_cpu:.2} s",
        st.prepare,
        N as f64 / st.prepare.as_secs_f64() / 1e6,
        st.post,
        wall,
        N as f64 / wall.as_secs_f64(),
        st.work_requests,
        st.doorbells
    );
    // Idle: nothing in flight; the progress tasks park.
    std::thread::sleep(Duration::from_millis(200));
    let (c0, _) = block_on(a.counters())?;
    let cpu0 = cpu_seconds();
    let t = Instant::now();
    std::thread::sleep(idle);
    let cpu = cpu_seconds() - cpu0;
    let (c1, inflight) = block_on(a.counters())?;
    println!(
        "{mode:?}: idle for {:.1} s: process CPU {:.3} s ({:.2} % of one core) for 2 engines; empty polls during idle {}, parks {}, in flight {inflight}",
        t.elapsed().as_secs_f64(),
        cpu,
        100.0 * cpu / t.elapsed().as_secs_f64(),
        c1.empty_polls - c0.empty_polls,
        c1.parks - c0.parks
    );
    pool.shutdown();
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let idle = args
        .iter()
        .position(|a| a == "--idle-secs")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(10);
    run(PollMode::Busy, Duration::from_secs(idle))?;
    run(PollMode::Event, Duration::from_secs(idle))?;
    Ok(())
}
