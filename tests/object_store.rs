//! The OBJECT tier against a real S3-compatible server (`s3s-fs`, started by each test on
//! loopback): put and get, ranged reads, a 64 MiB multipart upload, a missing key and bucket,
//! wrong credentials, a server killed or hung mid-transfer, a server that answers with errors,
//! and malformed descriptors. Every byte read back is compared.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{bytes, dram, local_agent as agent, StandIn};
use futures_lite::future::block_on;
use rixl::agent::{Agent, AgentError, CallOptions};
use rixl::object::{ObjectConfig, ObjectDesc, ObjectError, ObjectRegistration, ObjectSpec};
use rixl::runtime::{InvalidDescriptor, LocalDescList, Op};
use rixl_testkit::s3::{S3Server, ACCESS_KEY, SECRET_KEY};

const BUCKET: &str = "rixl-kv";

fn spec(s3: &S3Server, prefix: &str) -> ObjectSpec {
    ObjectSpec::new(s3.endpoint(), BUCKET, prefix).credentials(ACCESS_KEY, SECRET_KEY)
}

async fn register(a: &Agent, s3: &S3Server, prefix: &str) -> ObjectRegistration {
    a.register_object(spec(s3, prefix))
        .await
        .expect("register the bucket")
}

fn object_err(e: AgentError) -> ObjectError {
    match e {
        AgentError::Object(e) => e,
        other => panic!("expected an object error, got {other:?}"),
    }
}

#[test]
fn object_put_get_and_ranged_reads_round_trip() {
    let Some(s3) = S3Server::start("object_put_get", BUCKET) else {
        return;
    };
    let a = agent("obj-rt");
    block_on(async {
        let objs = register(&a, &s3, "run1").await;
        let block = 64u64 << 10;
        let src = dram(&a, (16 * block) as usize, Some(7)).await;
        // Sixteen blocks to eight objects of two blocks each, taken from scattered places.
        let mut local = LocalDescList::new();
        let mut descs = Vec::new();
        for i in 0..8u64 {
            local.push(src.region(), (15 - i) * block, block);
            local.push(src.region(), i * block, block);
            descs.push(ObjectDesc::new(format!("layer/{i}"), 0, block));
            descs.push(ObjectDesc::new(format!("layer/{i}"), block, block));
        }
        let st = a.write_object(&local, &objs, &descs).await.unwrap();
        assert_eq!(st.bytes, 16 * block);
        let c = objs.counters();
        assert_eq!(
            (c.puts, c.multipart_uploads, c.bytes_written),
            (8, 0, 16 * block)
        );
        assert_eq!(objs.size("layer/3").await.unwrap(), Some(2 * block));
        // On the server's disk, under the prefix.
        assert!(s3.root().join(BUCKET).join("run1/layer/3").is_file());

        // Whole objects back into another region, in another order.
        let dst = dram(&a, (16 * block) as usize, None).await;
        let mut local = LocalDescList::new();
        let mut descs = Vec::new();
        for i in 0..8u64 {
            local.push(dst.region(), 2 * i * block, 2 * block);
            descs.push(ObjectDesc::new(format!("layer/{}", 7 - i), 0, 2 * block));
        }
        a.read_object(&local, &objs, &descs).await.unwrap();
        for i in 0..8u64 {
            let obj = 7 - i;
            let got = bytes(dst.region(), 2 * i * block, 2 * block as usize);
            let mut want = bytes(src.region(), (15 - obj) * block, block as usize);
            want.extend(bytes(src.region(), obj * block, block as usize));
            assert!(got == want, "object layer/{obj}");
        }
        let c = objs.counters();
        assert_eq!(
            c.checksums_verified, 8,
            "whole-object reads check the stored CRC"
        );

        // Ranges inside objects: 1000 bytes across the block boundary of layer/2, 1 byte of 5.
        let dst2 = dram(&a, 4096, None).await;
        let mut local = LocalDescList::new();
        local.push(dst2.region(), 0, 1000);
        local.push(dst2.region(), 2000, 1);
        let descs = [
            ObjectDesc::new("layer/2", block - 500, 1000),
            ObjectDesc::new("layer/5", 2 * block - 1, 1),
        ];
        a.read_object(&local, &objs, &descs).await.unwrap();
        let mut want = bytes(src.region(), 13 * block + block - 500, 500);
        want.extend(bytes(src.region(), 2 * block, 500));
        assert_eq!(bytes(dst2.region(), 0, 1000), want);
        assert_eq!(
            bytes(dst2.region(), 2000, 1),
            bytes(src.region(), 5 * block + block - 1, 1)
        );
        assert_eq!(
            objs.counters().checksums_verified,
            8,
            "partial reads have no whole CRC"
        );
    });
}

#[test]
fn object_multipart_64_mib_with_parallel_ranged_reads() {
    let Some(s3) = S3Server::start("object_multipart", BUCKET) else {
        return;
    };
    let a = agent("obj-mp");
    block_on(async {
        let objs = register(&a, &s3, "weights").await;
        let len = 64usize << 20;
        let src = dram(&a, len, Some(21)).await;
        let mut local = LocalDescList::new();
        local.push(src.region(), 0, len as u64);
        let st = a
            .write_object(&local, &objs, &[ObjectDesc::new("shard-0", 0, len as u64)])
            .await
            .unwrap();
        let c = objs.counters();
        assert_eq!((c.multipart_uploads, c.parts, c.puts), (1, 8, 0), "{c:?}");
        assert_eq!(st.bytes, len as u64);
        assert_eq!(objs.size("shard-0").await.unwrap(), Some(len as u64));
        let pool = objs.bounce_pool().counters();
        assert!(
            pool.allocated <= objs.bounce_pool().capacity() && pool.high_water >= 2,
            "staging stays within the pool and overlaps parts: {pool:?}"
        );
        let dst = dram(&a, len, None).await;
        let mut local = LocalDescList::new();
        local.push(dst.region(), 0, len as u64);
        a.read_object(&local, &objs, &[ObjectDesc::new("shard-0", 0, len as u64)])
            .await
            .unwrap();
        assert_eq!(objs.counters().gets, 8, "one ranged GET per part");
        assert!(bytes(dst.region(), 0, len) == bytes(src.region(), 0, len));
    });
}

#[test]
fn object_missing_key_bucket_and_wrong_credentials_are_typed() {
    let Some(s3) = S3Server::start("object_missing", BUCKET) else {
        return;
    };
    let a = agent("obj-missing");
    block_on(async {
        let objs = register(&a, &s3, "p").await;
        let dst = dram(&a, 4096, None).await;
        let mut local = LocalDescList::new();
        local.push(dst.region(), 0, 16);
        let e = a
            .read_object(&local, &objs, &[ObjectDesc::new("nothing-here", 0, 16)])
            .await
            .unwrap_err();
        assert!(
            matches!(object_err(e), ObjectError::NotFound { ref key, .. } if key == "nothing-here")
        );
        assert_eq!(objs.size("nothing-here").await.unwrap(), None);

        let mut s = spec(&s3, "p");
        s.bucket = "no-such-bucket".into();
        let e = a.register_object(s).await.unwrap_err();
        assert!(
            matches!(object_err(e), ObjectError::NoSuchBucket { ref bucket, .. } if bucket == "no-such-bucket")
        );

        let s = spec(&s3, "p").credentials(ACCESS_KEY, "wrong-secret");
        let e = a.register_object(s).await.unwrap_err();
        assert!(
            matches!(object_err(e), ObjectError::Unauthorized { .. }),
            "wrong secret"
        );
        let s = spec(&s3, "p").credentials("nobody", SECRET_KEY);
        let e = object_err(a.register_object(s).await.unwrap_err());
        assert!(
            matches!(e, ObjectError::Unauthorized { .. }),
            "unknown key id: {e:?}"
        );
    });
}

#[test]
fn object_malformed_descriptors_are_refused_before_anything_is_written() {
    let Some(s3) = S3Server::start("object_malformed", BUCKET) else {
        return;
    };
    let a = agent("obj-bad");
    block_on(async {
        let objs = register(&a, &s3, "p").await;
        let src = dram(&a, 8192, Some(3)).await;
        let mut local = LocalDescList::new();
        local.push(src.region(), 0, 4096);
        let cases: Vec<(Vec<ObjectDesc>, &str)> = vec![
            (vec![], "empty"),
            (
                vec![ObjectDesc::new("a", 0, 0), ObjectDesc::new("a", 0, 4096)],
                "zero length",
            ),
            (vec![ObjectDesc::new("a", 0, 4000)], "length mismatch"),
            (vec![ObjectDesc::new("../etc", 0, 4096)], "bad key"),
            (vec![ObjectDesc::new("", 0, 4096)], "empty key"),
            (vec![ObjectDesc::new("a", 100, 4096)], "hole at the start"),
            (
                vec![
                    ObjectDesc::new("a", 0, 2048),
                    ObjectDesc::new("a", 4096, 2048),
                ],
                "hole",
            ),
        ];
        for (descs, what) in cases {
            let e = a.write_object(&local, &objs, &descs).await.unwrap_err();
            let e = object_err(e);
            let ok = match what {
                "empty" => matches!(
                    e,
                    ObjectError::InvalidDescriptor(InvalidDescriptor::Empty { .. })
                ),
                "zero length" => matches!(
                    e,
                    ObjectError::InvalidDescriptor(InvalidDescriptor::ZeroLength { index: 0, .. })
                ),
                "length mismatch" => matches!(
                    e,
                    ObjectError::InvalidDescriptor(InvalidDescriptor::LengthMismatch { .. })
                ),
                "bad key" | "empty key" => matches!(e, ObjectError::InvalidKey { index: 0, .. }),
                "hole at the start" => matches!(
                    e,
                    ObjectError::NotWhole {
                        index: 0,
                        expected: 0,
                        ..
                    }
                ),
                "hole" => matches!(
                    e,
                    ObjectError::NotWhole {
                        index: 1,
                        expected: 2048,
                        ..
                    }
                ),
                _ => false,
            };
            assert!(ok, "{what}: {e:?}");
        }
        assert_eq!(objs.size("a").await.unwrap(), None, "nothing was written");
        assert_eq!(objs.counters().transfers, 0);
        // A local descriptor outside its region.
        let mut bad = LocalDescList::new();
        bad.push(src.region(), 8000, 4096);
        let e = a
            .write_object(&bad, &objs, &[ObjectDesc::new("a", 0, 4096)])
            .await
            .unwrap_err();
        assert!(matches!(object_err(e), ObjectError::InvalidDescriptor(_)));
        // Reads past the end of a real object fail before any byte moves.
        a.write_object(&local, &objs, &[ObjectDesc::new("a", 0, 4096)])
            .await
            .unwrap();
        let dst = dram(&a, 8192, None).await;
        let mut two = LocalDescList::new();
        two.push(dst.region(), 0, 100);
        two.push(dst.region(), 100, 100);
        let e = a
            .read_object(
                &two,
                &objs,
                &[
                    ObjectDesc::new("a", 0, 100),
                    ObjectDesc::new("a", 4000, 100),
                ],
            )
            .await
            .unwrap_err();
        assert!(matches!(
            object_err(e),
            ObjectError::OutOfRange {
                index: 1,
                size: 4096,
                ..
            }
        ));
        assert_eq!(bytes(dst.region(), 0, 200), vec![0u8; 200], "no byte moved");
        assert_eq!(objs.counters().gets, 0);
    });
}

#[test]
fn object_server_killed_mid_transfer_leaves_no_object() {
    let Some(mut s3) = S3Server::start("object_killed", BUCKET) else {
        return;
    };
    let a = agent("obj-kill");
    let mut cfg = ObjectConfig::default();
    cfg.max_retries = 1;
    cfg.timeout = Duration::from_secs(30);
    let objs = block_on(a.register_object(spec(&s3, "p").config(cfg))).unwrap();
    let slow = StandIn::new(Duration::from_millis(150));
    let objs_slow = objs.with_copier(slow.clone());
    let len = 64usize << 20;
    let src = block_on(dram(&a, len, Some(5)));
    let mut local = LocalDescList::new();
    local.push(src.region(), 0, len as u64);
    let descs = [ObjectDesc::new("big", 0, len as u64)];
    let (result, ()) = std::thread::scope(|sc| {
        let writer = sc.spawn(|| block_on(a.write_object(&local, &objs_slow, &descs)));
        // Kill the server once some parts are staged (the upload has started).
        while slow.copies.load(Ordering::SeqCst) < 3 {
            std::thread::sleep(Duration::from_millis(10));
        }
        s3.kill();
        (writer.join().unwrap(), ())
    });
    let e = object_err(result.unwrap_err());
    assert!(
        matches!(
            e,
            ObjectError::Request {
                op: "multipart upload",
                ..
            }
        ),
        "typed request error: {e:?}"
    );
    s3.restart();
    block_on(async {
        assert_eq!(
            objs.size("big").await.unwrap(),
            None,
            "no partial object is visible"
        );
        // A complete object stays complete when the server dies during a read of it.
        let mut small = LocalDescList::new();
        small.push(src.region(), 0, 16 << 20);
        a.write_object(&small, &objs, &[ObjectDesc::new("whole", 0, 16 << 20)])
            .await
            .unwrap();
    });
    let dst = block_on(dram(&a, 16 << 20, None));
    let mut back = LocalDescList::new();
    back.push(dst.region(), 0, 16 << 20);
    let before = slow.copies.load(Ordering::SeqCst);
    let result = std::thread::scope(|sc| {
        let reader = sc.spawn(|| {
            block_on(a.read_object(&back, &objs_slow, &[ObjectDesc::new("whole", 0, 16 << 20)]))
        });
        while slow.copies.load(Ordering::SeqCst) == before && !reader.is_finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        s3.kill();
        reader.join().unwrap()
    });
    // The first range may have landed before the kill; the read as a whole must fail typed, or
    // (if both ranges were in before the kill) succeed with the right bytes.
    match result {
        Err(e) => assert!(
            matches!(object_err(e), ObjectError::Request { op: "get", .. }),
            "typed read error"
        ),
        Ok(_) => assert!(bytes(dst.region(), 0, 16 << 20) == bytes(src.region(), 0, 16 << 20)),
    }
    s3.restart();
    assert_eq!(block_on(objs.size("whole")).unwrap(), Some(16 << 20));
}

#[test]
fn object_hung_server_hits_the_deadline_and_errors_are_typed() {
    let Some(s3) = S3Server::start("object_hung", BUCKET) else {
        return;
    };
    let a = agent("obj-hung");
    block_on(async {
        let objs = register(&a, &s3, "p").await;
        let src = dram(&a, 1 << 20, Some(9)).await;
        let mut local = LocalDescList::new();
        local.push(src.region(), 0, 1 << 20);
        s3.pause(true);
        let t0 = std::time::Instant::now();
        let e = a
            .transfer_object(
                Op::Write,
                &local,
                &objs,
                &[ObjectDesc::new("slow", 0, 1 << 20)],
                CallOptions::new().timeout(Duration::from_millis(800)),
            )
            .await
            .unwrap_err();
        let waited = t0.elapsed();
        s3.pause(false);
        assert!(matches!(object_err(e), ObjectError::Timeout(_)));
        assert!(
            waited < Duration::from_secs(10),
            "the deadline fired ({waited:?})"
        );
        assert_eq!(
            objs.size("slow").await.unwrap(),
            None,
            "nothing half-written"
        );

        // A server that answers with errors: the key's parent is a file on the server's disk,
        // so the server cannot store the object and answers 500.
        let dir = s3.root().join(BUCKET).join("p");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("blocker"), b"x").unwrap();
        let e = a
            .write_object(
                &local,
                &objs,
                &[ObjectDesc::new("blocker/under", 0, 1 << 20)],
            )
            .await
            .unwrap_err();
        assert!(
            matches!(object_err(e), ObjectError::Request { op: "put", .. }),
            "server error is typed"
        );
        // The same registration still works afterwards.
        a.write_object(&local, &objs, &[ObjectDesc::new("fine", 0, 1 << 20)])
            .await
            .unwrap();
        assert_eq!(objs.size("fine").await.unwrap(), Some(1 << 20));
    });
}

#[test]
fn object_credentials_come_from_the_shared_profile_file() {
    let Some(s3) = S3Server::start("object_profile", BUCKET) else {
        return;
    };
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("object-profile");
    std::fs::create_dir_all(&dir).unwrap();
    let creds = dir.join("credentials");
    std::fs::write(
        &creds,
        format!("[default]\naws_access_key_id = nobody\naws_secret_access_key = wrong\n\n[rixl]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"),
    )
    .unwrap();
    // Only this test sets these (the others pass credentials in their specs).
    std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", &creds);
    std::env::set_var("AWS_CONFIG_FILE", dir.join("no-config"));
    let a = agent("obj-profile");
    block_on(async {
        std::env::set_var("AWS_PROFILE", "rixl");
        let objs = a
            .register_object(ObjectSpec::new(s3.endpoint(), BUCKET, "p"))
            .await
            .expect("the rixl profile's keys are accepted");
        let src = dram(&a, 4096, Some(1)).await;
        let mut local = LocalDescList::new();
        local.push(src.region(), 0, 4096);
        a.write_object(&local, &objs, &[ObjectDesc::new("k", 0, 4096)])
            .await
            .unwrap();
        std::env::set_var("AWS_PROFILE", "default");
        let e = a
            .register_object(ObjectSpec::new(s3.endpoint(), BUCKET, "p"))
            .await
            .unwrap_err();
        assert!(
            matches!(object_err(e), ObjectError::Unauthorized { .. }),
            "default profile's wrong keys"
        );
    });
    std::env::remove_var("AWS_PROFILE");
    std::env::remove_var("AWS_SHARED_CREDENTIALS_FILE");
    std::env::remove_var("AWS_CONFIG_FILE");
}

#[test]
fn object_a_key_given_in_separated_runs_is_written_in_object_order() {
    let Some(s3) = S3Server::start("object_runs", BUCKET) else {
        return;
    };
    let a = agent("obj-runs");
    block_on(async {
        let objs = register(&a, &s3, "runs").await;
        let mib = 1u64 << 20;
        let src = dram(&a, (24 * mib) as usize, Some(31)).await;
        // Object "a" (12 MiB: a multipart upload) in two runs with "b" (4 KiB) between them,
        // and "c" (8 KiB, one PUT) in two runs around "b".
        let mut local = LocalDescList::new();
        local.push(src.region(), 0, 6 * mib); // a 0..6M
        local.push(src.region(), 20 * mib, 4096); // c 0..4K
        local.push(src.region(), 12 * mib, 4096); // b
        local.push(src.region(), 21 * mib, 4096); // c 4K..8K
        local.push(src.region(), 6 * mib, 6 * mib); // a 6M..12M
        let descs = [
            ObjectDesc::new("a", 0, 6 * mib),
            ObjectDesc::new("c", 0, 4096),
            ObjectDesc::new("b", 0, 4096),
            ObjectDesc::new("c", 4096, 4096),
            ObjectDesc::new("a", 6 * mib, 6 * mib),
        ];
        a.write_object(&local, &objs, &descs).await.unwrap();
        let c = objs.counters();
        assert_eq!(
            (c.multipart_uploads, c.parts),
            (1, 2),
            "8 MiB + 4 MiB parts: {c:?}"
        );
        let dst = dram(&a, (24 * mib) as usize, None).await;
        let mut back = LocalDescList::new();
        back.push(dst.region(), 0, 12 * mib);
        back.push(dst.region(), 12 * mib, 4096);
        back.push(dst.region(), 13 * mib, 8192);
        a.read_object(
            &back,
            &objs,
            &[
                ObjectDesc::new("a", 0, 12 * mib),
                ObjectDesc::new("b", 0, 4096),
                ObjectDesc::new("c", 0, 8192),
            ],
        )
        .await
        .unwrap();
        assert!(
            bytes(dst.region(), 0, (12 * mib) as usize)
                == bytes(src.region(), 0, (12 * mib) as usize)
        );
        assert_eq!(
            bytes(dst.region(), 12 * mib, 4096),
            bytes(src.region(), 12 * mib, 4096)
        );
        let mut want_c = bytes(src.region(), 20 * mib, 4096);
        want_c.extend(bytes(src.region(), 21 * mib, 4096));
        assert_eq!(bytes(dst.region(), 13 * mib, 8192), want_c);
    });
}
