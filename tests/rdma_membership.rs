//! Membership through a real 3-member etcd cluster (Debian's etcd-server, three processes on
//! loopback) while agents churn, on a real device (rxe in the guest): a member is killed and
//! restarted under load, and the agents notice nothing beyond a log line. Skipped without a
//! device (a failure under `RIXL_REQUIRE_RDMA=1`).

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentConfig, RemoteRef, Visibility};
use rixl::runtime::LocalDescList;
use rixl_testkit::{fill, init_logs, report, require_or_skip};

/// Three etcd members on loopback, each with its own data directory.
struct Cluster {
    members: Vec<Member>,
    endpoints: String,
}

struct Member {
    name: String,
    args: Vec<String>,
    child: Option<Child>,
    client: String,
}

impl Member {
    fn spawn(&mut self) {
        let child = Command::new("etcd")
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd (Debian package etcd-server)");
        self.child = Some(child);
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Cluster {
    fn start() -> Cluster {
        let base = 24000 + (std::process::id() % 1000) as u16 * 6;
        let root = std::env::temp_dir().join(format!("rixl-etcd3-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let peer = |i: u16| format!("http://127.0.0.1:{}", base + 2 * i + 1);
        let initial: Vec<String> = (0..3).map(|i| format!("m{i}={}", peer(i))).collect();
        let mut members: Vec<Member> = (0..3u16)
            .map(|i| {
                let client = format!("127.0.0.1:{}", base + 2 * i);
                let dir = root.join(format!("m{i}"));
                let args = [
                    "--name",
                    &format!("m{i}"),
                    "--data-dir",
                    dir.to_str().expect("utf8 path"),
                    "--listen-client-urls",
                    &format!("http://{client}"),
                    "--advertise-client-urls",
                    &format!("http://{client}"),
                    "--listen-peer-urls",
                    &peer(i),
                    "--initial-advertise-peer-urls",
                    &peer(i),
                    "--initial-cluster",
                    &initial.join(","),
                    "--initial-cluster-state",
                    "new",
                    "--initial-cluster-token",
                    &format!("rixl-{}", std::process::id()),
                    // etcd's tuning guide for slow hosts: the emulated guest can stall a member
                    // past the default 100 ms heartbeat / 1 s election (elections churn).
                    "--heartbeat-interval",
                    "250",
                    "--election-timeout",
                    "2500",
                ]
                .map(String::from)
                .to_vec();
                Member {
                    name: format!("m{i}"),
                    args,
                    child: None,
                    client,
                }
            })
            .collect();
        for m in &mut members {
            m.spawn();
        }
        let endpoints = members
            .iter()
            .map(|m| m.client.clone())
            .collect::<Vec<_>>()
            .join(",");
        let t0 = Instant::now();
        for m in &members {
            let left = Duration::from_secs(30).saturating_sub(t0.elapsed());
            assert!(
                rixl_testkit::wait_listening(&m.client, left),
                "etcd {} did not start",
                m.name
            );
        }
        let cluster = Cluster { members, endpoints };
        let healthy = cluster.wait_healthy(Duration::from_secs(60));
        report(&format!(
            "etcd cluster: every member healthy after {healthy:?}"
        ));
        cluster
    }

    /// Waits until every member answers `etcdctl endpoint health` (a linearizable read: a
    /// leader is elected and the member serves through it), as a deployment waits before
    /// pointing agents at a new cluster. Listening is not enough: an agent joining while the
    /// members still elect their first leader in the emulated guest has timed out.
    fn wait_healthy(&self, within: Duration) -> Duration {
        let t0 = Instant::now();
        loop {
            let out = Command::new("etcdctl")
                .args([
                    "--endpoints",
                    &self.endpoints,
                    "--dial-timeout=2s",
                    "--command-timeout=3s",
                    "endpoint",
                    "health",
                ])
                .env("ETCDCTL_API", "3")
                .output()
                .expect("run etcdctl (Debian package etcd-client)");
            if out.status.success() {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < within,
                "etcd cluster not healthy after {within:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            m.kill();
        }
    }
}

fn agent(name: &str, cpu: usize) -> Agent {
    let mut cfg = AgentConfig::default();
    cfg.cpu = rixl::runtime::cpu_at(cpu);
    cfg.engine.transfer_timeout = Duration::from_secs(5);
    Agent::new(name, cfg).expect("agent")
}

fn wait_until(what: &str, timeout: Duration, f: impl Fn() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < timeout, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t0.elapsed()
}

#[test]
fn etcd_cluster_member_killed_and_restarted_while_agents_churn_changes_nothing_but_a_log_line() {
    init_logs();
    let Some(exporter) = require_or_skip("etcd_cluster", || {
        let mut cfg = AgentConfig::default();
        cfg.cpu = rixl::runtime::cpu_at(0);
        Agent::new("exporter", cfg)
    }) else {
        return;
    };
    let cluster = Cluster::start();
    let ns = format!("/rixl-cluster/{}", std::process::id());
    let ttl = Duration::from_secs(3);
    const LEN: usize = 4 << 20;
    let src = block_on(exporter.register(LEN, Visibility::All)).expect("src");
    let mut pattern = vec![0u8; LEN];
    fill(&mut pattern, 51);
    src.region().write_at(0, &pattern).unwrap();
    exporter.listen("127.0.0.1:0").expect("listen");
    exporter
        .join_etcd(&cluster.endpoints, &ns, ttl)
        .expect("exporter joins");
    let user = agent("user", 1);
    user.listen("127.0.0.1:0").expect("listen");
    user.join_etcd(&cluster.endpoints, &ns, ttl)
        .expect("user joins");
    wait_until(
        "the user knows the exporter",
        Duration::from_secs(10),
        || user.peers().contains(&"exporter".to_string()),
    );
    let dst = block_on(user.register(LEN, Visibility::All)).expect("dst");
    // Connected before the load starts, as a serving engine warms up (NIXL's makeConnection):
    // a set-up while three etcd members boot in the emulated guest has taken longer than one
    // 5 s deadline; it is retried here, typed each time.
    let t0 = Instant::now();
    while let Err(e) = block_on(user.connect("exporter")) {
        assert!(t0.elapsed() < Duration::from_secs(30), "connect: {e}");
        report(&format!("connect to the exporter: {e}; again"));
    }
    // Verified transfers all the time, from the moment the user knows the exporter.
    let stop = AtomicBool::new(false);
    // Stops the transfer thread even when an assertion below fails (the scope would wait).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    let (ok, failed) = (AtomicU64::new(0), AtomicU64::new(0));
    let churned = std::thread::scope(|s| {
        s.spawn(|| {
            let mut l = LocalDescList::new();
            l.push(dst.region(), 0, LEN as u64);
            let r = [RemoteRef {
                region: src.id(),
                offset: 0,
                len: LEN as u64,
            }];
            let mut got = vec![0u8; LEN];
            while !stop.load(Ordering::Relaxed) {
                dst.region().write_at(0, &[0u8; 4096]).unwrap();
                match block_on(user.read("exporter", &l, &r)) {
                    Ok(_) => {
                        dst.region().read_at(0, &mut got).unwrap();
                        assert!(got == pattern, "corrupted bytes");
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        eprintln!("transfer failed: {e}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        // Churners join and leave every second; a member is killed after the second, and
        // restarted after the fifth.
        let _stop = StopOnDrop(&stop);
        let mut seen = Vec::new();
        let mut cluster = cluster;
        for round in 0..8 {
            if round == 2 {
                cluster.members[0].kill();
                report("etcd member m0 killed");
            }
            if round == 5 {
                cluster.members[0].spawn();
                report("etcd member m0 restarted");
            }
            let name = format!("churner-{round}");
            let c = agent(&name, round);
            let _reg = block_on(c.register(1 << 20, Visibility::All)).expect("churner region");
            c.listen("127.0.0.1:0").expect("listen");
            c.join_etcd(&cluster.endpoints, &ns, ttl)
                .expect("a churner joins with one member down or not");
            let joined = wait_until(
                &format!("the user sees {name}"),
                Duration::from_secs(10),
                || user.peers().contains(&name),
            );
            c.shutdown();
            let left = wait_until(
                &format!("the user sees {name} leave"),
                Duration::from_secs(10),
                || !user.peers().contains(&name),
            );
            seen.push(format!(
                "{name}: seen after {joined:?}, gone after {left:?}"
            ));
            assert!(
                user.peers().contains(&"exporter".to_string()),
                "the exporter is never dropped"
            );
        }
        seen
    });
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    let (uc, ec) = (user.membership_counters(), exporter.membership_counters());
    report(&format!(
        "etcd cluster: {ok} verified transfers, {failed} failed; user {uc:?}; exporter {ec:?}\n  {}",
        churned.join("\n  ")
    ));
    assert_eq!(failed, 0, "every transfer to the live exporter succeeds");
    assert!(ok > 0, "transfers ran");
    // A member's death may end a session (and let a lease lapse): peers whose key went but who
    // still answered were kept, never invalidated.
    assert_eq!(uc.departures, 8, "exactly the churners departed: {uc:?}");
    user.shutdown();
    exporter.shutdown();
}
