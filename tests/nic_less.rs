//! Agents without a NIC (a GPU node whose peers are reached by CUDA IPC only): metadata and
//! notifications travel on the authenticated side channel, with the same bounds as on RDMA.
//! Runs on a host without RDMA (this machine, CI); skips, saying so, where a NIC is present.

use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use futures_lite::StreamExt;
use rixl::agent::metadata::AgentMetadata;
use rixl::agent::{Agent, AgentConfig, AgentError, ClusterKey};

fn nic_less(name: &str, tune: impl FnOnce(&mut AgentConfig)) -> Option<Agent> {
    rixl_testkit::init_logs();
    let mut cfg = AgentConfig::default()
        .with_cluster_key(ClusterKey::env_or_process_local().expect("a cluster key"));
    cfg.engine.require_nic = false;
    cfg.io_memory = 1 << 20;
    tune(&mut cfg);
    let a = Agent::new(name, cfg).expect("agent");
    if a.has_nic() {
        eprintln!(
            "SKIPPED nic_less_ ({name}): this machine has an RDMA device, so the agent has a NIC"
        );
        return None;
    }
    Some(a)
}

/// Two NIC-less agents that know each other: `(a, b)`.
fn pair(
    a_cfg: impl FnOnce(&mut AgentConfig),
    b_cfg: impl FnOnce(&mut AgentConfig),
) -> Option<(Agent, Agent)> {
    let a = nic_less("nicless-a", a_cfg)?;
    let b = nic_less("nicless-b", b_cfg)?;
    let a_addr = a.listen("127.0.0.1:0").expect("listen").to_string();
    let b_addr = b.listen("127.0.0.1:0").expect("listen").to_string();
    assert_eq!(
        b.fetch_remote_metadata(&a_addr).expect("metadata"),
        "nicless-a"
    );
    assert_eq!(
        a.fetch_remote_metadata(&b_addr).expect("metadata"),
        "nicless-b"
    );
    Some((a, b))
}

#[test]
fn nic_less_agents_exchange_metadata_and_notifications_on_the_side_channel() {
    let Some((a, b)) = pair(|_| {}, |_| {}) else {
        return;
    };
    // The metadata says so: peers know to use the side channel.
    let key = ClusterKey::env_or_process_local().expect("key");
    let md =
        AgentMetadata::decode(&a.local_metadata("nicless-b").expect("md"), &key).expect("decode");
    assert!(!md.nic, "a NIC-less agent's metadata says it has no NIC");
    let mut inbox = a.notifications().expect("stream");
    let t0 = Instant::now();
    for i in 0..100u32 {
        block_on(b.notify("nicless-a", format!("block {i} landed").as_bytes())).expect("notify");
    }
    let sent = t0.elapsed();
    for i in 0..100u32 {
        let (from, msg) = block_on(inbox.next()).expect("a notification");
        assert_eq!(from, "nicless-b", "the authenticated sender's name");
        assert_eq!(msg, format!("block {i} landed").as_bytes(), "in order");
    }
    // Both ways, and the largest notification.
    let mut back = b.notifications().expect("stream");
    let big = vec![0xabu8; rixl::agent::MAX_NOTIFICATION];
    block_on(a.notify("nicless-b", &big)).expect("largest notification");
    assert_eq!(
        block_on(back.next()).expect("one"),
        ("nicless-a".into(), big)
    );
    rixl_testkit::report(&format!(
        "NIC-less: 100 notifications on the side channel in {sent:?} ({:?} each)",
        sent / 100
    ));
    a.shutdown();
    b.shutdown();
}

#[test]
fn nic_less_bad_input_floods_and_dead_peers_get_typed_errors() {
    // The receiver allows 200 notifications a second (bursts of 20), and the sender's calls
    // end after 1.5 s.
    let Some((a, b)) = pair(
        |c| c.notification_rate = 200,
        |c| c.engine.transfer_timeout = Duration::from_millis(1500),
    ) else {
        return;
    };
    let mut inbox = a.notifications().expect("stream");
    for bad in [Vec::new(), vec![1u8; rixl::agent::MAX_NOTIFICATION + 1]] {
        assert!(matches!(
            block_on(b.notify("nicless-a", &bad)),
            Err(AgentError::NotificationTooLarge(n)) if n == bad.len()
        ));
    }
    assert!(matches!(
        block_on(b.notify("nobody", b"x")),
        Err(AgentError::UnknownPeer { .. })
    ));
    // A flood past the rate cap is paced, not dropped: 60 at 200/s after a burst of 20 take
    // at least 0.2 s, and all arrive in order.
    let t0 = Instant::now();
    for i in 0..60u32 {
        block_on(b.notify("nicless-a", &i.to_be_bytes())).expect("paced");
    }
    let paced = t0.elapsed();
    assert!(paced >= Duration::from_millis(190), "paced: {paced:?}");
    for i in 0..60u32 {
        assert_eq!(block_on(inbox.next()).expect("one").1, i.to_be_bytes());
    }
    // A dead peer: a typed error within the caller's deadline, never a hang.
    a.shutdown();
    let t0 = Instant::now();
    let r = block_on(b.notify("nicless-a", b"anyone?"));
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(
        matches!(
            r,
            Err(AgentError::SideChannelIo { .. } | AgentError::SideChannel(_))
        ),
        "{r:?}"
    );
    rixl_testkit::report(&format!(
        "NIC-less flood: 60 notifications paced to {paced:?}; dead peer: {r:?}"
    ));
    b.shutdown();
}

#[test]
fn nic_less_a_full_stream_refuses_typed_and_loses_nothing() {
    let Some((a, b)) = pair(|_| {}, |_| {}) else {
        return;
    };
    let mut inbox = a.notifications().expect("stream");
    // Fill the stream until it refuses: after a bounded wait, typed.
    let queue = rixl::agent::NOTIFICATION_QUEUE as u32;
    let mut accepted = 0u32;
    let (r, waited) = loop {
        let t0 = Instant::now();
        match block_on(b.notify("nicless-a", &accepted.to_be_bytes())) {
            Ok(()) => accepted += 1,
            Err(e) => break (e, t0.elapsed()),
        }
        assert!(accepted <= queue + 8, "the stream is bounded");
    };
    assert!(accepted >= queue, "the stream holds {queue}: {accepted}");
    assert!(
        matches!(&r, AgentError::SideChannel(m) if m.contains("busy")),
        "{r:?}"
    );
    assert!(
        waited >= rixl::agent::SIDE_NOTIFY_WAIT && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    // Everything accepted is there, in order; the refused one is not.
    for i in 0..accepted {
        assert_eq!(block_on(inbox.next()).expect("one").1, i.to_be_bytes());
    }
    // Drained: accepted again.
    block_on(b.notify("nicless-a", b"after")).expect("room again");
    assert_eq!(block_on(inbox.next()).expect("one").1, b"after");
    a.shutdown();
    b.shutdown();
}
