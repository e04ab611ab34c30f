//! Elastic membership under load: agent processes join and leave (clean shutdown and SIGKILL)
//! while the others read verified blocks from each other all the time, with membership
//! through a real etcd.
//!
//! ```text
//! churn [--secs 120] [--members 6] [--period-ms 3000] [--etcd host:port,...]
//! ```
//! Without `--etcd` it starts its own etcd-server on loopback. It prints one line per event and
//! a summary; it exits non-zero if a byte was corrupted, a transfer to a live peer failed, a
//! transfer to a departed peer took longer than its deadline + 1 s, or a member leaked
//! connections or in-flight transfers.
//!
//! Every block of a member's region describes itself (its first 16 bytes hold the member's seed
//! and the block index; the rest is a pattern of both), so a reader verifies what it read
//! without knowing which incarnation of the peer served it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, AgentError, CallOptions, RemoteRef, Visibility};
use rixl::runtime::{LocalDescList, Op, TransferError};
use rixl_testkit::{block_intact, fill_block, thread_dump, wait_listening};

type BoxError = Box<dyn std::error::Error>;

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 512;
/// A transfer's deadline, its connection set-up included. In the 2-vCPU emulated guest, with six
/// busy members, the first set-ups to a member that just joined (five peers at once, while it
/// sets up its own) took up to 2 s: 3 of 5,571 transfers timed out at a 2 s deadline, all to the
/// newest member in the run's first second; verified transfers took median 19 ms, p99.9
/// 0.8-0.9 s, max 1.7 s.
const DEADLINE: Duration = Duration::from_secs(5);
/// How long after a peer came back its old errors may still arrive (set-up backoff, metadata
/// refresh).
const SETTLE: Duration = Duration::from_secs(4);

#[derive(Debug, Parser)]
#[command(about = "Agents join and leave while the others run verified transfers")]
struct Args {
    /// How long to churn.
    #[arg(long, default_value_t = 120)]
    secs: u64,
    /// Agent processes.
    #[arg(long, default_value_t = 6)]
    members: usize,
    /// Time between two departures.
    #[arg(long, default_value_t = 3000)]
    period_ms: u64,
    /// etcd endpoints (comma-separated); default: start an etcd-server on loopback.
    #[arg(long)]
    etcd: Option<String>,
    /// Run as one member (internal).
    #[arg(long, hide = true)]
    member: Option<String>,
    /// The member's seed (internal).
    #[arg(long, hide = true, default_value_t = 0)]
    seed: u64,
    /// The member's CPU (internal).
    #[arg(long, hide = true, default_value_t = 0)]
    cpu: usize,
    /// etcd namespace (internal).
    #[arg(long, hide = true, default_value = "/rixl-churn")]
    ns: String,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One member: exports its blocks, reads random runs of its peers' blocks until told to quit
/// (a line on stdin, or its end), then shuts down cleanly and reports its leak census.
fn member(args: &Args, name: &str, etcd: &str) -> Result<(), BoxError> {
    let mut cfg = AgentConfig::default();
    cfg.cpu = rixl::runtime::cpu_at(args.cpu);
    cfg.engine.transfer_timeout = DEADLINE;
    // Dead peers are found within ~0.2 s (4.096 µs x 2^12 per retry, 3 retries).
    cfg.engine.connect.timeout = 12;
    cfg.engine.connect.retry_cnt = 3;
    cfg.connect_timeout = DEADLINE;
    // A core that stops running for twice a deadline has stalled (the default waits 60 s).
    cfg.engine.stall_timeout = DEADLINE * 2;
    let agent = Agent::new(name, cfg)?;
    let len = (BLOCK * BLOCKS) as usize;
    let src = block_on(agent.register(len, Visibility::All))?;
    let mut data = vec![0u8; len];
    for (b, chunk) in data.chunks_mut(BLOCK as usize).enumerate() {
        fill_block(chunk, args.seed, b as u64);
    }
    src.region().write_at(0, &data)?;
    let dst = block_on(agent.register(len, Visibility::All))?;
    agent.listen("127.0.0.1:0")?;
    agent.join_etcd(etcd, &args.ns, Duration::from_secs(3))?;
    let out = Arc::new(Mutex::new(std::io::stdout()));
    writeln!(out.lock().expect("stdout"), "READY {name} {}", now_ms())?;
    let quit = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let quit = Arc::clone(&quit);
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            quit.store(true, std::sync::atomic::Ordering::SeqCst);
        });
    }
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let mut buf = vec![0u8; len];
    let mut dumped = false;
    while !quit.load(std::sync::atomic::Ordering::SeqCst) {
        let peers: Vec<String> = agent.peers().into_iter().filter(|p| p != name).collect();
        if peers.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let peer = &peers[rng.usize(..peers.len())];
        let n = rng.u64(1..=16);
        let first = rng.u64(0..BLOCKS - n);
        let at = rng.u64(0..BLOCKS - n);
        let mut local = LocalDescList::new();
        let mut remote = Vec::new();
        for k in 0..n {
            local.push(dst.region(), (at + k) * BLOCK, BLOCK);
            remote.push(RemoteRef {
                region: src.id(),
                offset: (first + k) * BLOCK,
                len: BLOCK,
            });
        }
        let start = now_ms();
        let t0 = Instant::now();
        let opts = CallOptions::new().timeout(DEADLINE);
        let r = block_on(agent.transfer_with(peer, Op::Read, &local, &remote, opts));
        let took = t0.elapsed();
        let outcome = match r {
            Ok(_) => {
                let run = &mut buf[..(n * BLOCK) as usize];
                dst.region().read_at(at * BLOCK, run)?;
                let intact = run
                    .chunks(BLOCK as usize)
                    .enumerate()
                    .all(|(k, b)| block_intact(b, first + k as u64).is_some());
                if intact { "ok" } else { "corrupt" }.to_string()
            }
            Err(e) => {
                if !dumped && matches!(e.transfer_error(), Some(TransferError::EngineStalled(_))) {
                    // A core that stopped running: how its threads stand (kernel side, and
                    // user space where the guest has gdb), once, while it still has.
                    dumped = true;
                    let mut o = out.lock().expect("stdout");
                    for l in thread_dump().into_iter().chain(gdb_stacks()) {
                        writeln!(o, "STALLED {name} {l}")?;
                    }
                }
                format!("err {}", kind(&e))
            }
        };
        writeln!(
            out.lock().expect("stdout"),
            "R {start} {} {peer} {outcome}",
            start + took.as_millis() as u64
        )?;
    }
    // The leak census, before shutdown (a connection being closed may take up to its grace
    // period to go).
    let t0 = Instant::now();
    let (census, inflight) = loop {
        let census = block_on(agent.connection_census());
        let inflight: usize = block_on(agent.rail_inflight()).iter().sum();
        if (census.balanced() && inflight == 0) || t0.elapsed() > Duration::from_secs(3) {
            break (census, inflight);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    writeln!(
        out.lock().expect("stdout"),
        "CENSUS {name} engines={} known={} inflight={inflight} unanswered={} nudged={}",
        census.engines.iter().sum::<usize>(),
        census.known,
        census.unanswered.len(),
        agent.core_nudges().iter().sum::<u64>()
    )?;
    agent.shutdown();
    Ok(())
}

/// Every thread's user-space stack (`gdb` attached to this process for a moment), or nothing
/// without `gdb`.
fn gdb_stacks() -> Vec<String> {
    let pid = std::process::id().to_string();
    Command::new("timeout")
        .args([
            "60",
            "gdb",
            "-p",
            &pid,
            "-batch",
            "-ex",
            "thread apply all bt 24",
        ])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with('#') || l.starts_with("Thread"))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// A short name for an error's kind.
fn kind(e: &AgentError) -> String {
    let first = |s: String| {
        s.split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or("?")
            .to_string()
    };
    match e {
        AgentError::Incomplete { source, .. } => {
            format!("Incomplete/{}", first(format!("{source:?}")))
        }
        _ => first(format!("{e:?}")),
    }
}

/// What the orchestrator knows of one member name.
#[derive(Default)]
struct Life {
    /// Departure windows: from the departure until SETTLE after the next incarnation is ready
    /// (open while it is away).
    away: Vec<(u64, Option<u64>)>,
}

#[derive(Default)]
struct Tally {
    ok: u64,
    corrupt: u64,
    failed_live: Vec<String>,
    typed_departed: u64,
    late: Vec<String>,
    leaks: Vec<String>,
    censuses: u64,
    /// Nudges the members' watchdogs sent their silent cores.
    nudges: u64,
    kinds: HashMap<String, u64>,
    /// How long the verified transfers took, in ms (a connection set-up included).
    ok_ms: Option<hdrhistogram::Histogram<u64>>,
    /// The slowest verified transfer's line.
    slowest_ok: Option<(u64, String)>,
}

struct Running {
    child: Child,
    seed: u64,
}

fn spawn_member(
    exe: &std::path::Path,
    args: &Args,
    name: &str,
    seed: u64,
    cpu: usize,
    etcd: &str,
    lines: &std::sync::mpsc::Sender<String>,
) -> Result<Running, BoxError> {
    let mut child = Command::new(exe)
        .args(["--member", name, "--seed", &seed.to_string()])
        .args(["--cpu", &cpu.to_string(), "--etcd", etcd, "--ns", &args.ns])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let tx = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    Ok(Running { child, seed })
}

/// Waits for `name`'s READY line, keeping the other lines it reads.
fn wait_ready(
    rx: &std::sync::mpsc::Receiver<String>,
    name: &str,
    backlog: &mut Vec<String>,
) -> Result<u64, BoxError> {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(30) {
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
            let f: Vec<&str> = line.split(' ').collect();
            if f.len() == 3 && f[0] == "READY" && f[1] == name {
                return Ok(f[2].parse()?);
            }
            backlog.push(line);
        }
    }
    Err(format!("{name} did not become ready").into())
}

struct Etcd(Child, std::path::PathBuf);

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn start_etcd() -> Result<(Etcd, String), BoxError> {
    let port = 26000 + (std::process::id() % 1000) as u16 * 2;
    let dir = std::env::temp_dir().join(format!("rixl-churn-etcd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let endpoint = format!("127.0.0.1:{port}");
    let child = Command::new("etcd")
        .args(["--data-dir", dir.to_str().ok_or("path")?])
        .args(["--listen-client-urls", &format!("http://{endpoint}")])
        .args(["--advertise-client-urls", &format!("http://{endpoint}")])
        .args([
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{}", port + 1),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let etcd = Etcd(child, dir);
    if !wait_listening(&endpoint, Duration::from_secs(20)) {
        return Err("etcd did not start".into());
    }
    Ok((etcd, endpoint))
}

fn tally_line(line: &str, lives: &HashMap<String, Life>, t: &mut Tally) {
    let f: Vec<&str> = line.split(' ').collect();
    match f.as_slice() {
        ["R", start, end, peer, outcome @ ..] => {
            let (start, end): (u64, u64) = (start.parse().unwrap_or(0), end.parse().unwrap_or(0));
            let departed = lives.get(*peer).is_some_and(|l| {
                l.away.iter().any(|&(from, to)| {
                    let to = to.map_or(u64::MAX, |r| r + SETTLE.as_millis() as u64);
                    start <= to && end >= from
                })
            });
            match outcome {
                ["ok"] => {
                    t.ok += 1;
                    let took = end.saturating_sub(start);
                    if let Some(h) = t.ok_ms.as_mut() {
                        h.saturating_record(took);
                    }
                    if t.slowest_ok.as_ref().is_none_or(|(ms, _)| took > *ms) {
                        t.slowest_ok = Some((took, line.to_string()));
                    }
                }
                ["corrupt"] => t.corrupt += 1,
                ["err", kind] => {
                    *t.kinds.entry((*kind).to_string()).or_default() += 1;
                    if !departed {
                        t.failed_live.push(line.to_string());
                    } else if end - start > (DEADLINE + Duration::from_secs(1)).as_millis() as u64 {
                        t.late.push(line.to_string());
                    } else {
                        t.typed_departed += 1;
                    }
                }
                _ => {}
            }
        }
        ["CENSUS", name, engines, known, inflight, unanswered, nudged] => {
            t.nudges += nudged
                .trim_start_matches("nudged=")
                .parse::<u64>()
                .unwrap_or(0);
            t.censuses += 1;
            let num = |s: &str, key: &str| -> usize {
                s.trim_start_matches(key).parse().unwrap_or(usize::MAX)
            };
            let (engines, known, inflight, unanswered) = (
                num(engines, "engines="),
                num(known, "known="),
                num(inflight, "inflight="),
                num(unanswered, "unanswered="),
            );
            if unanswered != 0 {
                t.leaks.push(format!(
                    "{name}: {unanswered} engines did not answer the census (their core stalled?)"
                ));
            } else if engines != known || inflight != 0 {
                t.leaks.push(format!(
                    "{name}: engines hold {engines} connections, the agent knows {known}; {inflight} transfers in flight"
                ));
            }
        }
        _ => {}
    }
}

fn orchestrate(args: &Args) -> Result<bool, BoxError> {
    let exe = std::env::current_exe()?;
    let (_etcd, endpoint) = match &args.etcd {
        Some(e) => (None, e.clone()),
        None => {
            let (etcd, ep) = start_etcd()?;
            (Some(etcd), ep)
        }
    };
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let mut backlog = Vec::new();
    let mut lives: HashMap<String, Life> = HashMap::new();
    let mut running: HashMap<String, Running> = HashMap::new();
    let names: Vec<String> = (0..args.members).map(|i| format!("member-{i}")).collect();
    let mut seed = 1u64;
    for (i, name) in names.iter().enumerate() {
        running.insert(
            name.clone(),
            spawn_member(&exe, args, name, seed, i, &endpoint, &tx)?,
        );
        seed += 1;
        wait_ready(&rx, name, &mut backlog)?;
        lives.entry(name.clone()).or_default();
    }
    println!("churn: {} members up on etcd {endpoint}", args.members);
    let start_ms = now_ms();
    let mut rng = fastrand::Rng::with_seed(7);
    let t0 = Instant::now();
    let (mut clean, mut killed) = (0u64, 0u64);
    let mut round = 0u64;
    while t0.elapsed() < Duration::from_secs(args.secs) {
        std::thread::sleep(Duration::from_millis(args.period_ms));
        while let Ok(l) = rx.try_recv() {
            backlog.push(l);
        }
        // One member leaves (clean or SIGKILL), and comes back after a second.
        let i = rng.usize(..names.len());
        let name = &names[i];
        let Some(mut m) = running.remove(name) else {
            continue;
        };
        let left = now_ms();
        lives
            .entry(name.clone())
            .or_default()
            .away
            .push((left, None));
        if round.is_multiple_of(2) {
            // Clean: quit, and it shuts down (its lease revoked).
            if let Some(mut stdin) = m.child.stdin.take() {
                let _ = writeln!(stdin, "quit");
            }
            let _ = m.child.wait();
            clean += 1;
            println!("churn: {name} (seed {}) left cleanly", m.seed);
        } else {
            let _ = m.child.kill();
            let _ = m.child.wait();
            killed += 1;
            println!("churn: {name} (seed {}) killed", m.seed);
        }
        round += 1;
        std::thread::sleep(Duration::from_millis(1000));
        running.insert(
            name.clone(),
            spawn_member(&exe, args, name, seed, i, &endpoint, &tx)?,
        );
        seed += 1;
        let ready = wait_ready(&rx, name, &mut backlog)?;
        if let Some(w) = lives.get_mut(name).and_then(|l| l.away.last_mut()) {
            w.1 = Some(ready);
        }
    }
    // Everyone quits cleanly and reports its census: from now on every member is departing.
    let end = now_ms();
    for name in running.keys() {
        lives
            .entry(name.clone())
            .or_default()
            .away
            .push((end, None));
    }
    for m in running.values_mut() {
        if let Some(mut stdin) = m.child.stdin.take() {
            let _ = writeln!(stdin, "quit");
        }
    }
    let mut ok_exits = 0;
    for (name, mut m) in running {
        match m.child.wait() {
            Ok(s) if s.success() => ok_exits += 1,
            other => println!("churn: {name} exited {other:?}"),
        }
    }
    drop(tx);
    backlog.extend(rx.iter());
    let mut t = Tally {
        ok_ms: hdrhistogram::Histogram::new(3).ok(),
        ..Tally::default()
    };
    for line in &backlog {
        tally_line(line, &lives, &mut t);
    }
    let mut kinds: Vec<_> = t.kinds.iter().collect();
    kinds.sort();
    for l in t.failed_live.iter().take(10) {
        println!("churn: FAILED to a live peer: {l}");
    }
    for l in t.late.iter().take(10) {
        println!("churn: LATE: {l}");
    }
    for l in &t.leaks {
        println!("churn: LEAK: {l}");
    }
    for l in backlog.iter().filter(|l| l.starts_with("STALLED ")) {
        println!("churn: {l}");
    }
    if let (Some(h), Some((_, slowest))) = (&t.ok_ms, &t.slowest_ok) {
        println!(
            "churn: verified transfers took median {} ms, p99 {} ms, p99.9 {} ms, max {} ms (the slowest: {slowest}); the run started at {start_ms}",
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max()
        );
    }
    for (name, life) in &lives {
        for (from, to) in &life.away {
            println!(
                "churn: {name} away from {from} until {}",
                to.map_or("the end".to_string(), |t| format!(
                    "{t} (+{} ms settle)",
                    SETTLE.as_millis()
                ))
            );
        }
    }
    println!(
        "churn summary: {} s, {} members, departures {} ({clean} clean, {killed} SIGKILL); transfers: {} verified ok, {} corrupted, {} failed to live peers, {} typed errors to departed peers, {} late; errors by kind {kinds:?}; leak checks: {} of {} clean shutdowns clean, {ok_exits} of {} final exits clean; {} nudges of silent cores",
        args.secs,
        args.members,
        clean + killed,
        t.ok,
        t.corrupt,
        t.failed_live.len(),
        t.typed_departed,
        t.late.len(),
        t.censuses as usize - t.leaks.len(),
        t.censuses,
        args.members,
        t.nudges,
    );
    Ok(t.corrupt == 0
        && t.failed_live.is_empty()
        && t.late.is_empty()
        && t.leaks.is_empty()
        && t.ok > 0
        && t.censuses >= args.members as u64
        && ok_exits == args.members)
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    if let Some(name) = args.member.clone() {
        let etcd = args.etcd.clone().ok_or("--member needs --etcd")?;
        // A member's warnings (set-ups that failed, cores that stalled) reach the report.
        rixl_testkit::init_logs_or("rixl=warn,rixl_runtime=warn");
        return member(&args, &name, &etcd);
    }
    if orchestrate(&args)? {
        println!("churn: passed");
        Ok(())
    } else {
        Err("churn: failed".into())
    }
}
