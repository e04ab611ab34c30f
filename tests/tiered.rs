//! The tiered KV cache through all four tiers on the host: DRAM standing in for the hot tier,
//! host DRAM, a real file, and a real S3-compatible server (s3s-fs). Blocks go down as the
//! tiers fill, come back on a hit, arrive intact, are written once per tier, and the
//! reload-or-recompute choice follows measured costs.

mod common;

use std::time::Duration;

use common::local_agent as agent;
use futures_lite::future::block_on;
use rixl::agent::{Agent, Visibility};
use rixl::object::{ObjectRegistration, ObjectSpec};
use rixl::runtime::{FileMode, FileSpec};
use rixl::tier::{block_key, Fifo, Lru, Policy, Tier, TierConfig, TierError, TieredCache};
use rixl_testkit::s3::{S3Server, ACCESS_KEY, SECRET_KEY};

const BLOCK: u64 = 16 << 10;
const BUCKET: &str = "rixl-tiers";

fn content(block: u64) -> Vec<u8> {
    rixl_testkit::patterned(BLOCK as usize, block)
}

struct Setup {
    agent: Agent,
    objects: ObjectRegistration,
    cache: TieredCache,
}

fn setup(
    s3: &S3Server,
    name: &str,
    (hot, host, file): (usize, usize, usize),
    recompute: Duration,
    policy: fn() -> Box<dyn Policy>,
) -> Setup {
    let a = agent(name);
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("tiered-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    block_on(async {
        let hot_mem = a
            .register(hot * BLOCK as usize, Visibility::All)
            .await
            .unwrap();
        let host_mem = a
            .register(host * BLOCK as usize, Visibility::All)
            .await
            .unwrap();
        let f = a
            .register_file(FileSpec::new(
                dir.join("tier.bin"),
                file as u64 * BLOCK,
                FileMode::Create,
            ))
            .await
            .unwrap();
        let objects = a
            .register_object(
                ObjectSpec::new(s3.endpoint(), BUCKET, name).credentials(ACCESS_KEY, SECRET_KEY),
            )
            .await
            .unwrap();
        let cfg = TierConfig::new(BLOCK, hot, host, file, recompute);
        let cache =
            TieredCache::new(&a, cfg, hot_mem, host_mem, f, objects.clone(), policy).unwrap();
        Setup {
            agent: a,
            objects,
            cache,
        }
    })
}

/// Acquires `blocks`, computes the missing ones, checks every one that arrived; returns where
/// each came from.
fn request(cache: &mut TieredCache, blocks: &[u64]) -> Vec<Option<Tier>> {
    let placed = block_on(cache.acquire(blocks)).unwrap();
    let mut buf = vec![0u8; BLOCK as usize];
    placed
        .iter()
        .map(|p| {
            let at = p.slot as u64 * BLOCK;
            match p.from {
                None => cache.hot_region().write_at(at, &content(p.block)).unwrap(),
                Some(t) => {
                    cache.hot_region().read_at(at, &mut buf).unwrap();
                    assert!(
                        buf == content(p.block),
                        "block {} from {t:?} intact",
                        p.block
                    );
                }
            }
            p.from
        })
        .collect()
}

fn lru() -> Box<dyn Policy> {
    Box::new(Lru::default())
}

#[test]
fn tiered_blocks_go_down_every_tier_and_come_back_intact() {
    let Some(s3) = S3Server::start("tiered_down_up", BUCKET) else {
        return;
    };
    let mut s = setup(&s3, "down-up", (4, 4, 12), Duration::from_secs(1), lru);
    // 24 distinct blocks through 4 + 4 + 12 slots: the first four end in the object store.
    for b in 0..24u64 {
        assert_eq!(request(&mut s.cache, &[b]), vec![None], "block {b} is new");
    }
    assert_eq!(s.cache.locate(0), Some(Tier::Object));
    assert_eq!(s.cache.locate(5), Some(Tier::File));
    assert_eq!(s.cache.locate(17), Some(Tier::Host));
    assert_eq!(s.cache.locate(23), Some(Tier::Hot));
    assert_eq!(
        block_on(s.objects.size(&block_key(0))).unwrap(),
        Some(BLOCK),
        "archived as one object per block"
    );
    // Hits in every tier are promoted back, with their bytes.
    assert_eq!(
        request(&mut s.cache, &[0, 5, 17, 23]),
        vec![
            Some(Tier::Object),
            Some(Tier::File),
            Some(Tier::Host),
            Some(Tier::Hot),
        ]
    );
    for b in [0, 5, 17, 23] {
        assert_eq!(s.cache.locate(b), Some(Tier::Hot));
    }
    let st = s.cache.stats();
    for t in Tier::ALL {
        assert!(st.tier(t).hits >= 1, "{t:?} hit");
    }
    for t in [Tier::Host, Tier::File, Tier::Object] {
        assert!(
            st.tier(t).bytes_out >= BLOCK && st.tier(t).per_block.is_some(),
            "{t:?} measured"
        );
        assert!(st.tier(t).bytes_in >= 4 * BLOCK, "{t:?} took blocks");
    }
    // Write once: block 5 came back from the file and is still stored there; pushed down
    // again by new blocks, it is not written to the file a second time. Blocks 0..4 were
    // archived; pushed out of the file again, they are not put again.
    let before = s.cache.stats();
    let puts = s.objects.counters().puts;
    for b in 100..108u64 {
        request(&mut s.cache, &[b]);
    }
    let st = s.cache.stats();
    assert!(
        st.tier(Tier::File).writes_skipped > before.tier(Tier::File).writes_skipped,
        "{st:?}"
    );
    for b in 0..24u64 {
        assert!(
            request(&mut s.cache, &[b])[0].is_some(),
            "block {b} is somewhere in the tiers"
        );
    }
    let st = s.cache.stats();
    assert!(st.tier(Tier::Object).writes_skipped > 0, "{st:?}");
    // Each archived block is one object on the server's disk, put once.
    let on_disk = std::fs::read_dir(s3.root().join(BUCKET).join("down-up/blocks"))
        .unwrap()
        .count() as u64;
    assert_eq!(s.objects.counters().puts, on_disk, "no block was put twice");
    assert!(
        s.objects.counters().puts > puts,
        "new demotions reached the store"
    );
    assert_eq!(st.misses, 32, "only the first touch of each block misses");
    s.agent.shutdown();
}

#[test]
fn tiered_reload_or_recompute_follows_measured_costs() {
    let Some(s3) = S3Server::start("tiered_costs", BUCKET) else {
        return;
    };
    // Recomputing costs nothing: once a tier is measured, its hits are recomputed.
    let mut s = setup(
        &s3,
        "cheap-recompute",
        (2, 2, 8),
        Duration::from_nanos(1),
        lru,
    );
    for b in 0..8u64 {
        request(&mut s.cache, &[b]);
    }
    assert_eq!(s.cache.locate(0), Some(Tier::File));
    assert_eq!(
        request(&mut s.cache, &[0]),
        vec![Some(Tier::File)],
        "first hit measures the file"
    );
    assert_eq!(
        request(&mut s.cache, &[1]),
        vec![None],
        "then it is not worth reloading"
    );
    let st = s.cache.stats();
    assert_eq!(
        (st.tier(Tier::File).reloads, st.tier(Tier::File).recomputes),
        (1, 1)
    );
    s.agent.shutdown();
    // Recomputing is dear: every hit below is reloaded.
    let mut s = setup(
        &s3,
        "dear-recompute",
        (2, 2, 8),
        Duration::from_secs(5),
        lru,
    );
    for b in 0..8u64 {
        request(&mut s.cache, &[b]);
    }
    for b in 0..4u64 {
        assert_eq!(request(&mut s.cache, &[b]), vec![Some(Tier::File)]);
    }
    assert_eq!(s.cache.stats().tier(Tier::File).recomputes, 0);
    s.agent.shutdown();
}

#[test]
fn tiered_policy_is_pluggable_and_bad_requests_are_typed() {
    let Some(s3) = S3Server::start("tiered_policy", BUCKET) else {
        return;
    };
    // Hot tier of 2: A, B, A again, then C. LRU gives up B; FIFO gives up A.
    for (policy, gone, name) in [
        (lru as fn() -> Box<dyn Policy>, 1u64, "lru"),
        (
            (|| Box::new(Fifo::default()) as Box<dyn Policy>) as fn() -> Box<dyn Policy>,
            0,
            "fifo",
        ),
    ] {
        let mut s = setup(&s3, name, (2, 2, 4), Duration::from_secs(1), policy);
        for b in [0u64, 1, 0, 2] {
            request(&mut s.cache, &[b]);
        }
        assert_eq!(
            s.cache.locate(gone),
            Some(Tier::Host),
            "{name} demoted {gone}"
        );
        assert_eq!(
            s.cache.locate(1 - gone),
            Some(Tier::Hot),
            "{name} kept {}",
            1 - gone
        );
        let e = block_on(s.cache.acquire(&[7, 8, 9])).unwrap_err();
        assert!(matches!(
            e,
            TierError::TooManyBlocks {
                asked: 3,
                capacity: 2
            }
        ));
        // A request's own blocks are never its victims: both stay hot.
        assert_eq!(request(&mut s.cache, &[5, 6]), vec![None, None]);
        assert_eq!(
            request(&mut s.cache, &[5, 6]),
            vec![Some(Tier::Hot), Some(Tier::Hot)]
        );
        s.agent.shutdown();
    }
    let a = agent("tier-bad");
    block_on(async {
        let hot = a.register(4096, Visibility::All).await.unwrap();
        let host = a
            .register(8 * BLOCK as usize, Visibility::All)
            .await
            .unwrap();
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tiered-bad");
        std::fs::create_dir_all(&dir).unwrap();
        let f = a
            .register_file(FileSpec::new(
                dir.join("t.bin"),
                8 * BLOCK,
                FileMode::Create,
            ))
            .await
            .unwrap();
        let objects = a
            .register_object(
                ObjectSpec::new(s3.endpoint(), BUCKET, "bad").credentials(ACCESS_KEY, SECRET_KEY),
            )
            .await
            .unwrap();
        let e = TieredCache::new(
            &a,
            TierConfig::new(BLOCK, 2, 2, 2, Duration::ZERO),
            hot.clone(),
            host.clone(),
            f.clone(),
            objects.clone(),
            lru,
        )
        .unwrap_err();
        assert!(matches!(
            e,
            TierError::TooSmall {
                tier: Tier::Hot,
                ..
            }
        ));
        let e = TieredCache::new(
            &a,
            TierConfig::new(1000, 2, 2, 2, Duration::ZERO),
            hot,
            host,
            f,
            objects,
            lru,
        )
        .unwrap_err();
        assert!(matches!(e, TierError::UnalignedBlock(1000)));
    });
}

#[test]
fn tiered_example_runs_end_to_end() {
    let Some(s3) = S3Server::start("tiered_example", BUCKET) else {
        return;
    };
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tiered-example");
    let out = std::process::Command::new(rixl_testkit::example("tiered_kv"))
        .args(["--endpoint", &s3.endpoint(), "--bucket", BUCKET])
        .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
        .arg("--dir")
        .arg(&dir)
        .args(["--requests", "120"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tiered_kv failed");
    assert!(text.contains("tiered_kv: ok"), "it verified every block");
    for tier in ["Hot", "Host", "File", "Object"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(tier))
            .unwrap_or_else(|| panic!("a {tier} row"));
        let hits: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(hits > 0, "{tier} has hits: {line}");
    }
    assert!(
        text.contains("decision File:"),
        "a measured decision is printed"
    );
}
