//! Agent identity and a side channel that trusts nobody (`auth_`, `hostile_`, `flood_`). These
//! run on any machine: agents without a NIC still serve their side channel and metadata.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use rixl::agent::metadata::MetadataError;
use rixl::agent::{Agent, AgentConfig, AgentError, AuthError, ClusterKey};
use rixl_testkit::{rss_kib, send_long_line};

fn config(key: Option<ClusterKey>) -> AgentConfig {
    let mut cfg = AgentConfig::default();
    cfg.engine.require_nic = false;
    cfg.io_memory = 1 << 20;
    cfg.cluster_key = key;
    cfg.insecure = cfg.cluster_key.is_none();
    cfg
}

/// An agent holding `key` (`None`: insecure), listening on loopback.
fn agent(name: &str, key: Option<&ClusterKey>) -> (Agent, SocketAddr) {
    let a = Agent::new(name, config(key.cloned())).expect("agent starts without a NIC");
    let addr = a.listen("127.0.0.1:0").expect("listen");
    (a, addr)
}

fn key() -> ClusterKey {
    ClusterKey::generate().expect("a key")
}

/// A raw client: sends `lines`, returns every line the server answered until it closed.
fn raw(addr: SocketAddr, lines: &[&[u8]]) -> Vec<String> {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    for l in lines {
        if s.write_all(l).is_err() {
            break;
        }
    }
    let mut out = Vec::new();
    let mut r = BufReader::new(s);
    loop {
        let mut l = String::new();
        match r.read_line(&mut l) {
            Ok(0) | Err(_) => return out,
            Ok(_) => out.push(l.trim_end().to_string()),
        }
    }
}

/// Polls `cond` for up to 5 s.
fn eventually(cond: impl Fn() -> bool) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[test]
fn auth_agents_holding_the_cluster_key_fetch_metadata_and_others_are_refused_typed() {
    let k = key();
    let (a, addr) = agent("auth-a", Some(&k));
    let (b, _) = agent("auth-b", Some(&k));
    assert_eq!(
        b.fetch_remote_metadata(&addr.to_string()).expect("fetch"),
        "auth-a"
    );
    // Another cluster's agent: it sees that the server does not prove our key.
    let (c, _) = agent("auth-c", Some(&key()));
    match c.fetch_remote_metadata(&addr.to_string()) {
        Err(AgentError::Auth(AuthError::Forged { addr: at, claimed })) => {
            assert_eq!(claimed, "auth-a");
            assert_eq!(at, addr.to_string());
        }
        other => panic!("another key's agent got {other:?}"),
    }
    let counters = a.side_channel_counters();
    assert_eq!(counters.authenticated, 1, "{counters:?}");
    for x in [a, b, c] {
        x.shutdown();
    }
}

#[test]
fn auth_an_impostor_claiming_a_peers_name_is_refused_and_gets_nothing() {
    let k = key();
    let (a, addr) = agent("auth-owner", Some(&k));
    // It claims to be "auth-friend" and answers the challenge without the key.
    let hello = format!("RIXL1 HELLO auth-friend {}\n", "11".repeat(32));
    let forged_proof = format!("{} MD\n", "00".repeat(32));
    let answer = raw(addr, &[hello.as_bytes(), forged_proof.as_bytes()]);
    assert_eq!(answer.len(), 2, "a challenge, then a refusal: {answer:?}");
    assert!(answer[0].starts_with("RIXL1 CHALLENGE auth-owner "));
    assert_eq!(answer[1], "ERR authentication failed");
    // A replayed proof from another exchange does not verify either (fresh nonces): the
    // challenge's proof sent back as the client's.
    let server_proof = answer[0].rsplit(' ').next().unwrap().to_string();
    let replay = format!("{server_proof} MD\n");
    let again = raw(addr, &[hello.as_bytes(), replay.as_bytes()]);
    assert_eq!(
        again.last().map(String::as_str),
        Some("ERR authentication failed")
    );
    let c = a.side_channel_counters();
    assert_eq!((c.auth_failures, c.authenticated), (2, 0), "{c:?}");
    let census = futures_lite::future::block_on(a.connection_census());
    assert_eq!(
        census.known, 0,
        "no connection, no peer state for an impostor"
    );
    a.shutdown();
}

#[test]
fn auth_forged_metadata_is_a_typed_error_wherever_it_comes_from() {
    let k = key();
    let (a, _) = agent("auth-md-a", Some(&k));
    let (other, _) = agent("auth-md-x", Some(&key()));
    let foreign = other.local_metadata("auth-md-a").expect("metadata");
    assert!(matches!(
        a.load_remote_metadata(&foreign),
        Err(AgentError::Metadata(MetadataError::Forged))
    ));
    // One flipped byte of a genuine blob (its name here).
    let (b, _) = agent("auth-md-b", Some(&k));
    let mut blob = b.local_metadata("auth-md-a").expect("metadata");
    assert_eq!(a.load_remote_metadata(&blob).expect("genuine"), "auth-md-b");
    blob[14] ^= 0x20;
    assert!(matches!(
        a.load_remote_metadata(&blob),
        Err(AgentError::Metadata(MetadataError::Forged))
    ));
    for x in [a, b, other] {
        x.shutdown();
    }
}

#[test]
fn auth_insecure_agents_talk_only_to_insecure_agents() {
    let (a, addr) = agent("auth-open-a", None);
    let (b, _) = agent("auth-open-b", None);
    assert_eq!(
        b.fetch_remote_metadata(&addr.to_string())
            .expect("insecure pair"),
        "auth-open-a"
    );
    let (keyed, _) = agent("auth-keyed", Some(&key()));
    assert!(matches!(
        keyed.fetch_remote_metadata(&addr.to_string()),
        Err(AgentError::Auth(AuthError::Forged { .. }))
    ));
    for x in [a, b, keyed] {
        x.shutdown();
    }
}

#[test]
fn auth_an_agent_without_a_key_refuses_to_start_and_bad_names_are_refused() {
    if std::env::var_os("RIXL_CLUSTER_KEY").is_some()
        || std::env::var_os("RIXL_CLUSTER_KEY_FILE").is_some()
    {
        eprintln!(
            "SKIPPED the no-key half of auth_an_agent_without_a_key: the environment holds a key"
        );
    } else {
        let mut cfg = config(None);
        cfg.insecure = false;
        assert!(matches!(
            Agent::new("auth-keyless", cfg),
            Err(AgentError::Auth(AuthError::NoKey))
        ));
    }
    for bad in ["", "two words", "line\nbreak"] {
        assert!(
            matches!(
                Agent::new(bad, config(Some(key()))),
                Err(AgentError::Auth(AuthError::InvalidName(_)))
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn hostile_garbage_on_the_side_channel_gets_typed_refusals_and_the_agent_serves_on() {
    let k = key();
    let (a, addr) = agent("hostile-a", Some(&k));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty line", b"\n".to_vec()),
        ("old protocol", b"MD someone\n".to_vec()),
        ("non-ASCII", "RIXL1 HELLO ünïcödé ©©\n".as_bytes().to_vec()),
        ("invalid UTF-8", b"RIXL1 HELLO \xff\xfe\xfd x\n".to_vec()),
        ("short nonce", b"RIXL1 HELLO x 00\n".to_vec()),
        (
            "non-hex nonce",
            format!("RIXL1 HELLO x {}\n", "zz".repeat(32)).into_bytes(),
        ),
        (
            "wrong version",
            format!("RIXL9 HELLO x {}\n", "00".repeat(32)).into_bytes(),
        ),
        ("2 KiB hello", [vec![b'A'; 2048], b"\n".to_vec()].concat()),
    ];
    for (what, line) in &cases {
        let answer = raw(addr, &[line]);
        assert!(
            answer.len() == 1 && answer[0].starts_with("ERR "),
            "{what}: {answer:?}"
        );
    }
    let (b, _) = agent("hostile-b", Some(&k));
    assert_eq!(
        b.fetch_remote_metadata(&addr.to_string())
            .expect("served on"),
        "hostile-a"
    );
    let c = a.side_channel_counters();
    assert!(c.oversized >= 1 && c.malformed >= 6, "{c:?}");
    a.shutdown();
    b.shutdown();
}

#[test]
fn flood_10000_bogus_connections_and_a_64_mib_line_leave_the_agent_responsive_and_small() {
    let k = key();
    let (a, addr) = agent("flood-a", Some(&k));
    let (b, _) = agent("flood-b", Some(&k));
    let target = addr.to_string();
    assert_eq!(b.fetch_remote_metadata(&target).expect("warm"), "flood-a");
    let rss0 = rss_kib();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (fetches, slowest) = std::thread::scope(|s| {
        // The legitimate peer fetches all along.
        let legit = s.spawn(|| {
            let mut n = 0u32;
            let mut slowest = Duration::ZERO;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t0 = Instant::now();
                b.fetch_remote_metadata(&target)
                    .expect("a legitimate fetch during the flood");
                slowest = slowest.max(t0.elapsed());
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            (n, slowest)
        });
        // One 64 MiB line, written in 1 MiB pieces: the server stops reading at its limit.
        let big = s.spawn(|| send_long_line(addr, 64));
        // 10,000 bogus connections from 4 threads, 100 open at a time each: half send junk,
        // half a hello and then nothing.
        let bogus: Vec<_> = (0..4)
            .map(|t| {
                s.spawn(move || {
                    let mut made = 0u32;
                    for _ in 0..25 {
                        let mut open = Vec::new();
                        for i in 0..100 {
                            let Ok(mut c) = TcpStream::connect(addr) else {
                                continue;
                            };
                            let _ = if (i + t) % 2 == 0 {
                                c.write_all(b"GET / HTTP/1.1\r\n\r\n")
                            } else {
                                c.write_all(
                                    format!("RIXL1 HELLO bogus{t} {}\n", "00".repeat(32))
                                        .as_bytes(),
                                )
                            };
                            made += 1;
                            open.push(c);
                        }
                        drop(open);
                    }
                    made
                })
            })
            .collect();
        let made: u32 = bogus.into_iter().map(|h| h.join().unwrap()).sum();
        let (sent, reply) = big.join().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let legit = legit.join().unwrap();
        assert_eq!(made, 10_000, "every bogus connection was made");
        assert!(
            sent < 64 << 20 || reply.starts_with("ERR message too large"),
            "the 64 MiB line was cut off ({sent} bytes sent, reply {reply:?})"
        );
        legit
    });
    let grown = rss_kib().saturating_sub(rss0);
    let c = a.side_channel_counters();
    eprintln!(
        "flood: {fetches} legitimate fetches during it (slowest {slowest:?}), RSS +{grown} KiB, {c:?}"
    );
    assert!(fetches >= 1);
    assert!(grown < 50 << 10, "RSS grew by {grown} KiB");
    assert!(
        c.oversized >= 1,
        "the 64 MiB line was refused as oversized: {c:?}"
    );
    assert!(
        eventually(|| b.fetch_remote_metadata(&target).is_ok()),
        "responsive after the flood"
    );
    a.shutdown();
    b.shutdown();
}
