//! Grants enforced by the NIC, through the agent (`grant_`), on a real device (rxe in the
//! guest: `scripts/rdma-suite grant_`): a peer reaches only the regions granted to it, with the
//! rights granted, through windows bound to its own connection; revoking, invalidating and
//! releasing end access at once. The rogue member is played with the `failpoints` hook
//! `Agent::write_unchecked` (what raw verbs could post). Skipped without a device.
#![cfg(feature = "failpoints")]

use std::time::{Duration, Instant};

use futures_lite::future::block_on;
use rixl::agent::{
    Access, Agent, AgentConfig, AgentError, PeerAccess, Registration, RemoteRef, Visibility,
};
use rixl::runtime::{LocalDescList, TransferError};
use rixl_testkit::{init_logs, patterned, report, require_or_skip};

const LEN: usize = 64 << 10;

fn config(cpu: usize) -> AgentConfig {
    init_logs();
    let mut cfg = AgentConfig::default();
    cfg.cpu = rixl::runtime::cpu_at(cpu);
    // A first transfer to a peer connects within its deadline: under a loaded CI machine the
    // emulated guest took over 3 s for that once (ConnectTimeout). The NIC's refusals these
    // tests expect come back in milliseconds, well inside it.
    cfg.engine.transfer_timeout = Duration::from_secs(15);
    cfg.engine.connect.timeout = 14;
    cfg.engine.connect.retry_cnt = 3;
    cfg
}

fn whole(reg: &Registration) -> [RemoteRef; 1] {
    [RemoteRef {
        region: reg.id(),
        offset: 0,
        len: reg.region().len(),
    }]
}

fn list(reg: &Registration) -> LocalDescList {
    let mut l = LocalDescList::new();
    l.push(reg.region(), 0, reg.region().len());
    l
}

fn contents(reg: &Registration) -> Vec<u8> {
    let mut v = vec![0u8; reg.region().len() as usize];
    reg.region().read_at(0, &mut v).expect("read the region");
    v
}

/// Filled with `seed`'s pattern.
fn patterned_region(agent: &Agent, seed: u64, vis: Visibility) -> Registration {
    let reg = block_on(agent.register(LEN, vis)).expect("register");
    reg.region()
        .write_at(0, &patterned(LEN, seed))
        .expect("fill");
    reg
}

fn is_remote_access(e: &AgentError) -> bool {
    matches!(e.transfer_error(), Some(TransferError::RemoteAccess { .. }))
}

#[test]
fn grant_a_peer_reaches_only_its_grants_and_another_peers_key_fails_at_the_nic() {
    let Some(owner) = require_or_skip("grant_scoped", || Agent::new("grant-owner", config(1)))
    else {
        return;
    };
    let addr = owner.listen("127.0.0.1:0").expect("listen").to_string();
    let for_c = patterned_region(&owner, 1, Visibility::Only(vec!["grant-c".into()]));
    let for_b = patterned_region(&owner, 2, Visibility::Only(vec!["grant-b".into()]));
    let b = Agent::new("grant-b", config(0)).expect("agent");
    let c = Agent::new("grant-c", config(0)).expect("agent");
    for a in [&b, &c] {
        assert_eq!(
            a.fetch_remote_metadata(&addr).expect("metadata"),
            "grant-owner"
        );
    }
    let src_b = patterned_region(&b, 3, Visibility::All);
    let src_c = patterned_region(&c, 4, Visibility::All);
    // Each grantee writes its own region, through its window.
    block_on(c.write("grant-owner", &list(&src_c), &whole(&for_c))).expect("C writes its grant");
    block_on(b.write("grant-owner", &list(&src_b), &whole(&for_b))).expect("B writes its grant");
    assert!(contents(&for_c) == contents(&src_c) && contents(&for_b) == contents(&src_b));
    // B's metadata does not list C's region: the agent refuses before the wire.
    assert!(matches!(
        block_on(b.write("grant-owner", &list(&src_b), &whole(&for_c))),
        Err(AgentError::UnknownRegion { .. })
    ));
    // A rogue B with C's key and the right address: the NIC refuses, the memory is unchanged.
    let b_key = b.grant_keys_of("grant-owner").expect("B holds keys")[&for_b.id()];
    let c_keys = c.grant_keys_of("grant-owner").expect("C holds keys");
    let c_key = c_keys[&for_c.id()];
    let before = contents(&for_c);
    src_b
        .region()
        .write_at(0, &patterned(LEN, 9))
        .expect("fill");
    let t0 = Instant::now();
    let stolen =
        block_on(b.write_unchecked("grant-owner", &list(&src_b), for_c.region().addr(), c_key))
            .expect_err("C's key on B's connection");
    let took = t0.elapsed();
    assert!(
        is_remote_access(&stolen),
        "a remote access error: {stolen:?}"
    );
    assert!(contents(&for_c) == before, "C's region is unchanged");
    // The region's own key (the metadata's, which names it) reaches nothing either.
    let own = block_on(b.write_unchecked(
        "grant-owner",
        &list(&src_b),
        for_c.region().addr(),
        for_c.region().rkey(),
    ))
    .expect_err("the region's own key");
    assert!(is_remote_access(&own), "a remote access error: {own:?}");
    // Nor B's key for its own region, aimed at C's region's address (outside its window).
    let outside =
        block_on(b.write_unchecked("grant-owner", &list(&src_b), for_c.region().addr(), b_key))
            .expect_err("B's key outside its window");
    assert!(
        is_remote_access(&outside),
        "a remote access error: {outside:?}"
    );
    assert!(contents(&for_c) == before, "C's region is still unchanged");
    // C is not disturbed by B's faults, and B heals onto a new connection.
    block_on(c.read("grant-owner", &list(&src_c), &whole(&for_c))).expect("C reads on");
    block_on(b.read("grant-owner", &list(&src_b), &whole(&for_b))).expect("B reads again");
    assert!(contents(&src_b) == contents(&for_b));
    report(&format!(
        "grant_: C's key {c_key:#x} from B's queue pair -> {stolen} in {took:?}; the MR's key -> remote access error; B's key outside its window -> remote access error; owner windows {:?}",
        owner.grant_counters()
    ));
}

#[test]
fn grant_read_only_grants_refuse_writes_at_the_nic() {
    let Some(owner) = require_or_skip("grant_read_only", || {
        Agent::new("grant-ro-owner", config(1))
    }) else {
        return;
    };
    let addr = owner.listen("127.0.0.1:0").expect("listen").to_string();
    let weights = patterned_region(&owner, 5, Visibility::ReadOnly);
    let reader = Agent::new("grant-ro-reader", config(0)).expect("agent");
    let peer = reader.fetch_remote_metadata(&addr).expect("metadata");
    let dst = patterned_region(&reader, 6, Visibility::All);
    block_on(reader.read(&peer, &list(&dst), &whole(&weights))).expect("a read-only grant reads");
    assert!(contents(&dst) == contents(&weights));
    let before = contents(&weights);
    dst.region().write_at(0, &patterned(LEN, 7)).expect("fill");
    let w = block_on(reader.write(&peer, &list(&dst), &whole(&weights)))
        .expect_err("a WRITE through a read-only grant");
    assert!(is_remote_access(&w), "a remote access error: {w:?}");
    assert!(contents(&weights) == before, "the weights are unchanged");
    // The failed connection is replaced; reading goes on.
    block_on(reader.read(&peer, &list(&dst), &whole(&weights))).expect("reads again");
    assert!(contents(&dst) == before);
    // Rights per agent need a region granted by name: read-only for this reader first, then
    // read-write (its read-only window is deallocated at once).
    assert!(matches!(
        owner.grant(&weights, &peer_name(&reader), Access::ReadWrite),
        Err(AgentError::UnnamedRegion(_))
    ));
    let named = patterned_region(
        &owner,
        8,
        Visibility::Granted(vec![PeerAccess {
            agent: peer_name(&reader),
            access: Access::Read,
        }]),
    );
    reader.fetch_remote_metadata(&addr).expect("metadata again");
    block_on(reader.read(&peer, &list(&dst), &whole(&named))).expect("a read grant reads");
    assert!(block_on(reader.write(&peer, &list(&dst), &whole(&named))).is_err());
    owner
        .grant(&named, &peer_name(&reader), Access::ReadWrite)
        .expect("rights by name");
    reader.fetch_remote_metadata(&addr).expect("metadata again");
    dst.region().write_at(0, &patterned(LEN, 9)).expect("fill");
    let mut wrote = block_on(reader.write(&peer, &list(&dst), &whole(&named)));
    if wrote.is_err() {
        // The connection still held the read-only window's key: one failure, then a new one.
        wrote = block_on(reader.write(&peer, &list(&dst), &whole(&named)));
    }
    wrote.expect("a read-write grant writes");
    assert!(contents(&named) == contents(&dst));
    report(&format!(
        "grant_: read-only WRITE -> {w}; after grant(ReadWrite) by name the write landed"
    ));
}

fn peer_name(a: &Agent) -> String {
    a.name().to_string()
}

#[test]
fn grant_revoking_invalidating_and_releasing_end_access_at_once() {
    let Some(owner) = require_or_skip("grant_revoke", || Agent::new("grant-rv-owner", config(1)))
    else {
        return;
    };
    let addr = owner.listen("127.0.0.1:0").expect("listen").to_string();
    let granted = patterned_region(
        &owner,
        11,
        Visibility::Granted(vec![PeerAccess {
            agent: "grant-rv-b".into(),
            access: Access::ReadWrite,
        }]),
    );
    let shared = patterned_region(&owner, 12, Visibility::All);
    let b = Agent::new("grant-rv-b", config(0)).expect("agent");
    let c = Agent::new("grant-rv-c", config(0)).expect("agent");
    for a in [&b, &c] {
        a.fetch_remote_metadata(&addr).expect("metadata");
    }
    let dst_b = patterned_region(&b, 13, Visibility::All);
    let dst_c = patterned_region(&c, 14, Visibility::All);
    block_on(b.read("grant-rv-owner", &list(&dst_b), &whole(&granted))).expect("B reads");
    block_on(c.read("grant-rv-owner", &list(&dst_c), &whole(&shared))).expect("C reads");
    let live = owner.grant_counters().live;
    // Revoke B's grant: its window is deallocated before revoke returns.
    let t0 = Instant::now();
    let n = owner.revoke(&granted, "grant-rv-b").expect("revoke");
    let revoke_took = t0.elapsed();
    assert_eq!(n, 1, "one window (B's, rail 0)");
    let b_err = block_on(b.read("grant-rv-owner", &list(&dst_b), &whole(&granted)))
        .expect_err("B's read after the revocation");
    assert!(
        is_remote_access(&b_err),
        "the NIC refused B's old key: {b_err:?}"
    );
    // B's next try sets up again and fetches the metadata again: the region is gone for it.
    let again = block_on(b.read("grant-rv-owner", &list(&dst_b), &whole(&granted)));
    let again = match again {
        Err(AgentError::UnknownRegion { .. } | AgentError::NotGranted { .. }) => again,
        _ => block_on(b.read("grant-rv-owner", &list(&dst_b), &whole(&granted))),
    };
    assert!(
        matches!(
            again,
            Err(AgentError::UnknownRegion { .. } | AgentError::NotGranted { .. })
        ),
        "typed refusal after the revocation: {again:?}"
    );
    assert!(matches!(
        owner.revoke(&shared, "grant-rv-c"),
        Err(AgentError::UnnamedRegion(_))
    ));
    // Invalidating C deallocates every window of C at once.
    let c_key = c.grant_keys_of("grant-rv-owner").expect("C holds keys")[&shared.id()];
    block_on(owner.invalidate_remote("grant-rv-c"));
    assert!(
        owner.grant_counters().live < live,
        "C's windows went: {:?}",
        owner.grant_counters()
    );
    let e = block_on(c.write_unchecked(
        "grant-rv-owner",
        &list(&dst_c),
        shared.region().addr(),
        c_key,
    ))
    .expect_err("C's old key after the invalidation");
    assert!(e.transfer_error().is_some(), "a transfer error: {e:?}");
    // Releasing a region deallocates its windows: the release resolves, nothing holds it.
    let released = block_on(async {
        futures_lite::future::or(async { Some(shared.release().await) }, async {
            futures_timer::Delay::new(Duration::from_secs(10)).await;
            None
        })
        .await
    });
    assert!(
        released.is_some_and(|r| r.deregistered),
        "the release resolved and deregistered"
    );
    report(&format!(
        "grant_: revoke deallocated {n} window in {revoke_took:?}, B's next read -> {b_err}; after the revocation B gets {}; C after invalidate_remote -> {e}; after release: {:?}",
        again.expect_err("refused"),
        owner.grant_counters()
    ));
}

#[test]
fn grant_an_agent_without_nic_grants_and_one_with_them_transfer_both_ways() {
    let Some(with) = require_or_skip("grant_mixed", || Agent::new("grant-with", config(1))) else {
        return;
    };
    let mut cfg = config(0);
    cfg.nic_grants = false;
    let without = Agent::new("grant-without", cfg).expect("agent");
    let r_with = patterned_region(&with, 21, Visibility::All);
    let r_without = patterned_region(&without, 22, Visibility::All);
    let a_with = with.listen("127.0.0.1:0").expect("listen").to_string();
    let a_without = without.listen("127.0.0.1:0").expect("listen").to_string();
    with.fetch_remote_metadata(&a_without).expect("metadata");
    without.fetch_remote_metadata(&a_with).expect("metadata");
    block_on(with.read("grant-without", &list(&r_with), &whole(&r_without))).expect("read");
    assert!(contents(&r_with) == contents(&r_without));
    r_without
        .region()
        .write_at(0, &patterned(LEN, 23))
        .expect("fill");
    block_on(without.write("grant-with", &list(&r_without), &whole(&r_with))).expect("write");
    assert!(contents(&r_with) == contents(&r_without));
}
