//! True fault trials on two hosts (`scripts/fault-trials`, on two rxe guests joined by an
//! emulated wire). A user agent reads verified blocks from a peer agent all the time while
//! the peer, its link, its queue pair or etcd fails; every transfer must end in a typed error
//! within its deadline + 1 s, and once the fault clears the user's transfers must succeed
//! again with no call from the application (a restarted peer's new metadata arrives through
//! membership).
//!
//! ```text
//! fault_trials supervisor --listen 10.77.0.1:7100 --peer-listen 10.77.0.1:7000 --etcd 10.77.0.2:2379
//! fault_trials user --control 10.77.0.1:7100 [--runs 20] [--trials sigkill,sigstop,...]
//! ```
//! The supervisor runs next to the peer (guest 0): it starts, SIGKILLs, SIGSTOPs and SIGCONTs
//! the peer process, and takes its link down, on the user's commands. The user (guest 1) runs
//! etcd itself, drives the trials, and prints one line per run and the table
//! `trial | runs | typed errors in time | healed | bytes verified | leaks`. It exits non-zero
//! if any transfer ended late, a run did not heal, a byte was wrong, or anything leaked.
//!
//! The trials: `sigkill` (the peer killed mid-transfer, then restarted with new memory),
//! `sigstop` (stopped past the deadline, then continued), `linkdown` (the peer's netdev down
//! for `--link-down-secs`, then up), `qperror` (the user's queue pairs forced to error, with
//! the `failpoints` feature) and `etcd` (etcd killed and restarted, then the peer restarted).

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, AgentError, CallOptions, RemoteRef, Visibility};
use rixl::runtime::{LocalDescList, Op};
use rixl_testkit::{block_intact, fill_block, init_logs, patterned, wait_listening};

type BoxError = Box<dyn std::error::Error>;

const BLOCK: u64 = 64 << 10;
/// The peer's region: 128 blocks of 64 KiB.
const BLOCKS: u64 = 128;
/// Reader threads on the user; each reads its own blocks.
const READERS: u64 = 4;
/// A transfer's deadline.
const DEADLINE: Duration = Duration::from_secs(3);
/// How long a run may take to heal after its fault cleared.
const HEAL_WITHIN: Duration = Duration::from_secs(30);
const PEER: &str = "trial-peer";
const NAMESPACE: &str = "/rixl-trials";

#[derive(Debug, Parser)]
#[command(about = "Fault trials between two agents on two hosts")]
struct Args {
    #[command(subcommand)]
    role: Role,
}

#[derive(Debug, Subcommand)]
enum Role {
    /// Next to the peer: starts, signals and isolates it on the user's commands.
    Supervisor {
        /// Where to take commands.
        #[arg(long)]
        listen: String,
        /// The peer's side-channel address.
        #[arg(long)]
        peer_listen: String,
        /// etcd, for the peer.
        #[arg(long)]
        etcd: String,
        /// The netdev of the link to take down.
        #[arg(long, default_value = "eth0")]
        netdev: String,
    },
    /// Drives the trials.
    User {
        /// The supervisor's command address.
        #[arg(long)]
        control: String,
        /// Runs per trial.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// Trials to run, comma-separated.
        #[arg(long, default_value = "sigkill,sigstop,linkdown,qperror,etcd")]
        trials: String,
        /// How long the link stays down.
        #[arg(long, default_value_t = 20)]
        link_down_secs: u64,
        /// The address etcd listens on for the peer (this host's; it listens on loopback
        /// too, for the user).
        #[arg(long, default_value = "10.77.0.2:2379")]
        etcd_listen: String,
    },
    /// The peer (started by the supervisor).
    #[command(hide = true)]
    Peer {
        #[arg(long)]
        seed: u64,
        #[arg(long)]
        listen: String,
        #[arg(long)]
        etcd: String,
    },
}

/// Fast failure detection: 4.096 µs x 2^12 ≈ 17 ms per transport retry, 3 retries.
fn config(cpu: usize) -> AgentConfig {
    let mut cfg = AgentConfig::default();
    cfg.cpu = rixl::runtime::cpu_at(cpu);
    cfg.engine.connect.timeout = 12;
    cfg.engine.connect.retry_cnt = 3;
    cfg.engine.transfer_timeout = DEADLINE;
    cfg.connect_timeout = DEADLINE;
    cfg
}

// ---------------------------------------------------------------------------------------------
// The peer and its supervisor.

fn peer(seed: u64, listen: &str, etcd: &str) -> Result<(), BoxError> {
    let agent = Agent::new(PEER, config(1))?;
    let len = (BLOCK * BLOCKS) as usize;
    let reg = block_on(agent.register(len, Visibility::All))?;
    let mut data = vec![0u8; len];
    for (b, chunk) in data.chunks_mut(BLOCK as usize).enumerate() {
        fill_block(chunk, seed, b as u64);
    }
    reg.region().write_at(0, &data)?;
    // A restarted peer may wait for its old socket to go.
    let t0 = Instant::now();
    while let Err(e) = agent.listen(listen) {
        if t0.elapsed() > Duration::from_secs(10) {
            return Err(e.into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    agent.join_etcd(etcd, NAMESPACE, Duration::from_secs(3))?;
    println!("READY {}", reg.id());
    std::io::stdout().flush()?;
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    agent.shutdown();
    Ok(())
}

struct Supervised {
    child: Child,
}

fn signal(pid: u32, sig: &str) -> Result<(), BoxError> {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("kill -{sig} {pid} failed").into())
    }
}

fn ip_link(netdev: &str, state: &str) -> Result<(), BoxError> {
    let st = Command::new("ip")
        .args(["link", "set", netdev, state])
        .status()?;
    if st.success() {
        Ok(())
    } else {
        Err(format!("ip link set {netdev} {state} failed").into())
    }
}

fn start_peer(peer_listen: &str, etcd: &str, seed: u64) -> Result<(Supervised, String), BoxError> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["peer", "--seed", &seed.to_string()])
        .args(["--listen", peer_listen, "--etcd", etcd])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().ok_or("no stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    match line.trim().strip_prefix("READY ") {
        Some(region) => Ok((Supervised { child }, region.to_string())),
        None => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("the peer did not start: {line:?}").into())
        }
    }
}

/// One command: its reply.
fn command(
    line: &str,
    peer: &mut Option<Supervised>,
    peer_listen: &str,
    etcd: &str,
    netdev: &str,
) -> Result<String, BoxError> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let pid = || -> Result<u32, BoxError> {
        peer.as_ref()
            .map(|p| p.child.id())
            .ok_or_else(|| "no peer running".into())
    };
    match f.as_slice() {
        ["start", seed] => {
            if let Some(mut old) = peer.take() {
                let _ = old.child.kill();
                let _ = old.child.wait();
            }
            let (p, region) = start_peer(peer_listen, etcd, seed.parse()?)?;
            *peer = Some(p);
            Ok(format!("ok {region}"))
        }
        ["kill"] => {
            let mut p = peer.take().ok_or("no peer running")?;
            p.child.kill()?;
            p.child.wait()?;
            Ok("ok".into())
        }
        ["stop"] => signal(pid()?, "STOP").map(|()| "ok".into()),
        ["cont"] => signal(pid()?, "CONT").map(|()| "ok".into()),
        ["linkdown", secs] => {
            let secs: u64 = secs.parse()?;
            let netdev = netdev.to_string();
            // The reply goes out before the link does; the link comes back by itself.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                if let Err(e) = ip_link(&netdev, "down") {
                    eprintln!("supervisor: {e}");
                    return;
                }
                std::thread::sleep(Duration::from_secs(secs));
                if let Err(e) = ip_link(&netdev, "up") {
                    eprintln!("supervisor: {e}");
                }
            });
            Ok("ok".into())
        }
        _ => Err(format!("unknown command {line:?}").into()),
    }
}

fn supervisor(listen: &str, peer_listen: &str, etcd: &str, netdev: &str) -> Result<(), BoxError> {
    let listener = TcpListener::bind(listen)?;
    println!("supervisor: listening on {listen}");
    let mut peer: Option<Supervised> = None;
    // The user reconnects after a link-down trial; "bye" ends the supervisor.
    for stream in listener.incoming() {
        let stream = stream?;
        let mut out = stream.try_clone()?;
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if line.trim() == "bye" {
                if let Some(mut p) = peer.take() {
                    let _ = signal(p.child.id(), "CONT");
                    if let Some(stdin) = p.child.stdin.as_mut() {
                        let _ = writeln!(stdin, "quit");
                    }
                    let _ = p.child.wait();
                }
                let _ = writeln!(out, "ok");
                return Ok(());
            }
            let reply = command(&line, &mut peer, peer_listen, etcd, netdev)
                .unwrap_or_else(|e| format!("err {e}"));
            if writeln!(out, "{reply}").is_err() {
                break;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The user.

/// The command channel to the supervisor (reconnected when a link-down trial cut it).
struct Control {
    addr: String,
    conn: Option<(BufReader<TcpStream>, TcpStream)>,
}

impl Control {
    fn open(addr: &str) -> Result<Control, BoxError> {
        let mut c = Control {
            addr: addr.to_string(),
            conn: None,
        };
        c.reconnect(Duration::from_secs(180))?;
        Ok(c)
    }

    fn reconnect(&mut self, within: Duration) -> Result<(), BoxError> {
        let t0 = Instant::now();
        loop {
            match TcpStream::connect(&self.addr) {
                Ok(s) => {
                    s.set_read_timeout(Some(Duration::from_secs(60)))?;
                    self.conn = Some((BufReader::new(s.try_clone()?), s));
                    return Ok(());
                }
                Err(e) if t0.elapsed() > within => return Err(e.into()),
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }

    fn send(&mut self, cmd: &str) -> Result<String, BoxError> {
        for _ in 0..2 {
            if self.conn.is_none() {
                self.reconnect(Duration::from_secs(60))?;
            }
            let (r, w) = self.conn.as_mut().ok_or("no control connection")?;
            let mut line = String::new();
            if writeln!(w, "{cmd}").is_ok() && r.read_line(&mut line).is_ok_and(|n| n > 0) {
                let line = line.trim().to_string();
                return match line.strip_prefix("err ") {
                    Some(e) => Err(format!("supervisor: {cmd}: {e}").into()),
                    None => Ok(line.trim_start_matches("ok").trim().to_string()),
                };
            }
            self.conn = None;
        }
        Err(format!("supervisor unreachable for {cmd:?}").into())
    }
}

/// One transfer's outcome in a run.
#[derive(Debug)]
struct Outcome {
    at: Instant,
    took: Duration,
    /// The error's kind, `None` for a success.
    error: Option<String>,
}

/// What the readers saw in a run.
#[derive(Default)]
struct Seen {
    outcomes: Vec<Outcome>,
    verified_bytes: u64,
    corrupt: u64,
}

/// Readers that run while a fault is injected: each reads its blocks (into the same blocks of
/// `dst`) back to back and checks every block of every read that succeeded.
struct Load<'a> {
    user: &'a Agent,
    dst: &'a rixl::agent::Registration,
    region: u64,
}

impl Load<'_> {
    fn run(&self, stop: &AtomicBool, seen: &Mutex<Seen>) {
        std::thread::scope(|s| {
            for r in 0..READERS {
                s.spawn(move || {
                    let per = BLOCKS / READERS;
                    let mut buf = vec![0u8; (per * BLOCK) as usize];
                    while !stop.load(Ordering::Relaxed) {
                        let mut l = LocalDescList::new();
                        let mut remote = Vec::new();
                        for b in r * per..(r + 1) * per {
                            l.push(self.dst.region(), b * BLOCK, BLOCK);
                            remote.push(RemoteRef {
                                region: self.region,
                                offset: b * BLOCK,
                                len: BLOCK,
                            });
                        }
                        let opts = CallOptions::new().timeout(DEADLINE);
                        let t0 = Instant::now();
                        let res =
                            block_on(self.user.transfer_with(PEER, Op::Read, &l, &remote, opts));
                        let took = t0.elapsed();
                        let mut corrupt = 0;
                        if res.is_ok() {
                            self.dst
                                .region()
                                .read_at(r * per * BLOCK, &mut buf)
                                .expect("read back");
                            corrupt = buf
                                .chunks(BLOCK as usize)
                                .enumerate()
                                .filter(|(k, b)| block_intact(b, r * per + *k as u64).is_none())
                                .count() as u64;
                        }
                        let failed = res.is_err();
                        let mut seen = seen.lock().expect("seen");
                        seen.outcomes.push(Outcome {
                            at: t0,
                            took,
                            error: res.err().map(|e| kind(&e)),
                        });
                        if !failed {
                            seen.verified_bytes += per * BLOCK;
                            seen.corrupt += corrupt;
                        }
                        drop(seen);
                        if failed {
                            // Failing fast (backoff): do not spin.
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                });
            }
        });
    }
}

/// A short name for an error's kind (`Transfer(RemoteDisconnect)`, `ConnectTimeout`, ...).
fn kind(e: &AgentError) -> String {
    let s = format!("{e:?}");
    let word = |s: &str| {
        s.split(|c: char| !c.is_alphanumeric())
            .next()
            .unwrap_or("?")
            .to_string()
    };
    match e.transfer_error() {
        Some(t) => format!("{}({})", word(&s), word(&format!("{t:?}"))),
        None => word(&s),
    }
}

/// One run's result.
#[derive(Debug, Default)]
struct RunResult {
    errors: usize,
    in_time: usize,
    healed: bool,
    heal_after: Option<Duration>,
    verified_bytes: u64,
    corrupt: u64,
    leaked: bool,
    kinds: std::collections::BTreeMap<String, usize>,
}

struct Trials<'a> {
    user: &'a Agent,
    dst: &'a rixl::agent::Registration,
    canary: &'a rixl::agent::Registration,
    control: Control,
    etcd: Etcd,
    region: u64,
    seed: u64,
    link_down_secs: u64,
}

impl Trials<'_> {
    /// Runs `fault` while the readers read; `fault` returns when the fault has cleared. The run
    /// heals once a read that started after that succeeds.
    fn run(
        &mut self,
        fault: impl FnOnce(&mut Self) -> Result<(), BoxError>,
    ) -> Result<RunResult, BoxError> {
        let stop = AtomicBool::new(false);
        let seen = Mutex::new(Seen::default());
        let load = Load {
            user: self.user,
            dst: self.dst,
            region: self.region,
        };
        let healed = std::thread::scope(|s| -> Result<_, BoxError> {
            let readers = s.spawn(|| load.run(&stop, &seen));
            // Steady traffic first.
            std::thread::sleep(Duration::from_millis(500));
            let r = fault(self);
            let cleared = Instant::now();
            let mut healed = None;
            while r.is_ok() && cleared.elapsed() < HEAL_WITHIN {
                let ok_after = seen
                    .lock()
                    .expect("seen")
                    .outcomes
                    .iter()
                    .any(|o| o.error.is_none() && o.at >= cleared);
                if ok_after {
                    healed = Some(cleared.elapsed());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            // A little steady traffic after healing.
            std::thread::sleep(Duration::from_millis(300));
            stop.store(true, Ordering::Relaxed);
            readers.join().map_err(|_| "a reader panicked")?;
            r?;
            Ok(healed)
        })?;
        let seen = seen.into_inner().expect("seen");
        let mut res = RunResult {
            healed: healed.is_some(),
            heal_after: healed,
            verified_bytes: seen.verified_bytes,
            corrupt: seen.corrupt,
            ..RunResult::default()
        };
        for o in &seen.outcomes {
            if let Some(k) = &o.error {
                res.errors += 1;
                if o.took <= DEADLINE + Duration::from_secs(1) {
                    res.in_time += 1;
                }
                *res.kinds.entry(k.clone()).or_default() += 1;
            }
        }
        res.leaked = !self.quiescent();
        let mut canary = vec![0u8; CANARY];
        self.canary.region().read_at(0, &mut canary)?;
        if canary != patterned(CANARY, CANARY_SEED) {
            res.corrupt += 1;
        }
        Ok(res)
    }

    /// No queue pair leaked and nothing left in flight (waiting a moment for drains).
    fn quiescent(&self) -> bool {
        let t0 = Instant::now();
        loop {
            let census = block_on(self.user.connection_census());
            let inflight = block_on(self.user.rail_inflight());
            if census.balanced() && inflight.iter().all(|&n| n == 0) {
                return true;
            }
            if t0.elapsed() > Duration::from_secs(5) {
                eprintln!("leak: {census:?}, in flight {inflight:?}");
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Restarts the peer with new memory (a new seed).
    fn restart_peer(&mut self) -> Result<(), BoxError> {
        self.seed += 1;
        let region: u64 = self
            .control
            .send(&format!("start {}", self.seed))?
            .parse()?;
        if region != self.region {
            return Err(format!(
                "the restarted peer's region is {region}, not {}",
                self.region
            )
            .into());
        }
        Ok(())
    }

    fn sigkill(&mut self) -> Result<(), BoxError> {
        self.control.send("kill")?;
        std::thread::sleep(Duration::from_millis(500));
        self.restart_peer()
    }

    fn sigstop(&mut self) -> Result<(), BoxError> {
        self.control.send("stop")?;
        std::thread::sleep(DEADLINE + Duration::from_secs(1));
        self.control.send("cont")?;
        Ok(())
    }

    fn linkdown(&mut self) -> Result<(), BoxError> {
        self.control
            .send(&format!("linkdown {}", self.link_down_secs))?;
        // The command channel crosses the same link: wait it out, then reconnect.
        std::thread::sleep(Duration::from_secs(self.link_down_secs) + Duration::from_millis(500));
        self.control.conn = None;
        self.control.reconnect(Duration::from_secs(60))
    }

    fn qperror(&mut self) -> Result<(), BoxError> {
        if !cfg!(feature = "failpoints") {
            return Err("the qperror trial needs the failpoints feature".into());
        }
        let before = self.user.link_counters().retired;
        fail::cfg("rixl-qp-error", "1*return")?;
        let t0 = Instant::now();
        while self.user.link_counters().retired == before && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        fail::remove("rixl-qp-error");
        Ok(())
    }

    fn etcd_outage(&mut self) -> Result<(), BoxError> {
        let failed = || -> u64 {
            block_on(self.user.rail_counters())
                .iter()
                .map(|c| c.transfers_failed)
                .sum()
        };
        let (failed_before, links_before) = (failed(), self.user.link_counters());
        self.etcd.kill();
        // The data path does not notice: no transfer fails, no connection is touched.
        std::thread::sleep(Duration::from_secs(3));
        let links = self.user.link_counters();
        if failed() != failed_before || links.retired != links_before.retired {
            return Err(format!(
                "the etcd outage disturbed the data path: {} transfers failed, {links:?}",
                failed() - failed_before
            )
            .into());
        }
        self.etcd.start()?;
        // Then the peer restarts: its new metadata comes through the reconciled membership.
        std::thread::sleep(Duration::from_secs(1));
        self.sigkill()
    }
}

const CANARY: usize = 1 << 20;
const CANARY_SEED: u64 = 4242;

/// The user's own etcd (a single member, its data kept across a kill).
struct Etcd {
    listen: String,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl Etcd {
    fn start(&mut self) -> Result<(), BoxError> {
        let port: u16 = self
            .listen
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or("etcd listen address")?;
        let child = Command::new("etcd")
            .args(["--data-dir", self.dir.to_str().ok_or("path")?])
            .args([
                "--listen-client-urls",
                &format!("http://{},http://127.0.0.1:{port}", self.listen),
            ])
            .args([
                "--advertise-client-urls",
                &format!("http://{}", self.listen),
            ])
            .args([
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{}", port + 1),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        if !wait_listening(&format!("127.0.0.1:{port}"), Duration::from_secs(20)) {
            return Err("etcd did not start".into());
        }
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A table row.
#[derive(Default)]
struct Row {
    runs: usize,
    errors: usize,
    in_time: usize,
    healed: usize,
    heal_times: Vec<Duration>,
    verified_bytes: u64,
    corrupt: u64,
    leaks: usize,
    failed_runs: usize,
}

fn user(
    control: &str,
    runs: usize,
    trials: &str,
    link_down_secs: u64,
    etcd_listen: &str,
) -> Result<bool, BoxError> {
    let port = etcd_listen.rsplit(':').next().unwrap_or("2379");
    let mut etcd = Etcd {
        listen: etcd_listen.to_string(),
        dir: std::env::temp_dir().join(format!("rixl-trials-etcd-{}", std::process::id())),
        child: None,
    };
    etcd.start()?;
    let mut control = Control::open(control)?;
    let user = Agent::new("trial-user", config(0))?;
    user.join_etcd(
        &format!("127.0.0.1:{port}"),
        NAMESPACE,
        Duration::from_secs(3),
    )?;
    let seed = 1;
    let region: u64 = control.send(&format!("start {seed}"))?.parse()?;
    // The peer arrives through membership.
    let t0 = Instant::now();
    while !user.peers().iter().any(|p| p == PEER) {
        if t0.elapsed() > Duration::from_secs(30) {
            return Err("the peer never appeared in membership".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let dst = block_on(user.register((BLOCK * BLOCKS) as usize, Visibility::All))?;
    let canary = block_on(user.register(CANARY, Visibility::All))?;
    canary
        .region()
        .write_at(0, &patterned(CANARY, CANARY_SEED))?;
    let mut t = Trials {
        user: &user,
        dst: &dst,
        canary: &canary,
        control,
        etcd,
        region,
        seed,
        link_down_secs,
    };
    let mut table: Vec<(String, Row)> = Vec::new();
    for trial in trials.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let mut row = Row::default();
        for run in 0..runs {
            let r = match trial {
                "sigkill" => t.run(Trials::sigkill),
                "sigstop" => t.run(Trials::sigstop),
                "linkdown" => t.run(Trials::linkdown),
                "qperror" => t.run(Trials::qperror),
                "etcd" => t.run(Trials::etcd_outage),
                other => return Err(format!("unknown trial {other:?}").into()),
            };
            row.runs += 1;
            match r {
                Ok(r) => {
                    println!(
                        "trial {trial} run {run}: {} errors ({} in time) {:?}, healed {:?}, {} MiB verified, {} corrupt, leaked {}",
                        r.errors,
                        r.in_time,
                        r.kinds,
                        r.heal_after,
                        r.verified_bytes >> 20,
                        r.corrupt,
                        r.leaked
                    );
                    row.errors += r.errors;
                    row.in_time += r.in_time;
                    row.healed += usize::from(r.healed);
                    row.heal_times.extend(r.heal_after);
                    row.verified_bytes += r.verified_bytes;
                    row.corrupt += r.corrupt;
                    row.leaks += usize::from(r.leaked);
                }
                Err(e) => {
                    println!("trial {trial} run {run}: FAILED: {e}");
                    row.failed_runs += 1;
                }
            }
        }
        table.push((trial.to_string(), row));
    }
    let _ = t.control.send("bye");
    user.shutdown();
    println!();
    println!("| trial | runs | typed errors in time | healed | bytes verified | leaks |");
    println!("|---|---|---|---|---|---|");
    let mut pass = true;
    for (name, r) in &table {
        let mut times = r.heal_times.clone();
        times.sort();
        let median = times.get(times.len() / 2).copied().unwrap_or_default();
        let worst = times.last().copied().unwrap_or_default();
        println!(
            "| {name} | {} | {}/{} | {}/{} (median {:.2} s, worst {:.2} s) | {:.1} MiB, {} corrupt | {} |",
            r.runs,
            r.in_time,
            r.errors,
            r.healed,
            r.runs,
            median.as_secs_f64(),
            worst.as_secs_f64(),
            r.verified_bytes as f64 / f64::from(1 << 20),
            r.corrupt,
            r.leaks
        );
        pass &= r.failed_runs == 0
            && r.in_time == r.errors
            && r.healed == r.runs
            && r.corrupt == 0
            && r.leaks == 0;
    }
    println!("fault-trials: {}", if pass { "PASS" } else { "FAIL" });
    Ok(pass)
}

fn main() -> Result<(), BoxError> {
    init_logs();
    match Args::parse().role {
        Role::Supervisor {
            listen,
            peer_listen,
            etcd,
            netdev,
        } => supervisor(&listen, &peer_listen, &etcd, &netdev),
        Role::User {
            control,
            runs,
            trials,
            link_down_secs,
            etcd_listen,
        } => {
            if user(&control, runs, &trials, link_down_secs, &etcd_listen)? {
                Ok(())
            } else {
                std::process::exit(1)
            }
        }
        Role::Peer { seed, listen, etcd } => peer(seed, &listen, &etcd),
    }
}
