//! The agent's FILE memory on a real file (no RDMA needed): scattered DRAM <-> FILE round trips
//! with every byte verified, typed errors through the agent, and file handles that close.

mod common;

use common::local_agent as agent;
use futures_lite::future::block_on;
use rixl::agent::{AgentError, RemoteRef, Visibility};
use rixl::runtime::{FileDesc, FileError, FileMode, FileSpec, LocalDescList, TransferError};

fn dir(name: &str) -> std::path::PathBuf {
    let d =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("agent_file-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn scattered_blocks_round_trip_through_a_file() {
    let a = agent("file-rt");
    let d = dir("rt");
    let path = d.join("tier.bin");
    block_on(async {
        let block = 16u64 << 10;
        let blocks = 256u64;
        let src = a
            .register((blocks * block) as usize, Visibility::All)
            .await
            .unwrap();
        let dst = a
            .register((blocks * block) as usize, Visibility::All)
            .await
            .unwrap();
        let mut data = vec![0u8; (blocks * block) as usize];
        rixl_testkit::fill(&mut data, 14);
        src.region().write_at(0, &data).unwrap();
        let f = a
            .register_file(FileSpec::new(
                &path,
                2 * blocks * block,
                FileMode::CreateNew,
            ))
            .await
            .unwrap();
        assert_eq!(f.size(), 2 * blocks * block);
        // Even local blocks to odd file slots (reversed), then back into other local places.
        let mut local = LocalDescList::new();
        let mut descs = Vec::new();
        for i in 0..blocks / 2 {
            local.push(src.region(), 2 * i * block, block);
            descs.push(FileDesc::new((2 * (blocks - 1 - i) + 1) * block, block));
        }
        let st = a.write_file(&local, &f, &descs).await.unwrap();
        assert_eq!(st.bytes, blocks / 2 * block);
        let disk = std::fs::read(&path).unwrap();
        for (i, d) in descs.iter().enumerate() {
            let lo = 2 * i as u64 * block;
            assert_eq!(
                &disk[d.offset as usize..(d.offset + block) as usize],
                &data[lo as usize..(lo + block) as usize]
            );
        }
        let mut back = LocalDescList::new();
        for i in 0..blocks / 2 {
            back.push(dst.region(), (blocks - 1 - i) * block, block);
        }
        a.read_file(&back, &f, &descs).await.unwrap();
        for i in 0..blocks / 2 {
            let mut got = vec![0u8; block as usize];
            dst.region()
                .read_at((blocks - 1 - i) * block, &mut got)
                .unwrap();
            let lo = (2 * i * block) as usize;
            assert_eq!(got, data[lo..lo + block as usize]);
        }

        // Errors come back typed through the agent.
        let mut past = LocalDescList::new();
        past.push(dst.region(), 0, block);
        match a
            .read_file(&past, &f, &[FileDesc::new(f.size(), block)])
            .await
        {
            Err(AgentError::Transfer(TransferError::File(FileError::OutOfRange { .. }))) => {}
            other => panic!("{other:?}"),
        }
        match a
            .register_file(FileSpec::new(d.join("nope"), 4096, FileMode::Open))
            .await
        {
            Err(AgentError::File(FileError::NotFound { .. })) => {}
            other => panic!("{other:?}"),
        }
        // The handle closes the file when dropped: the path can be replaced and registered anew.
        drop(f);
        std::fs::remove_file(&path).unwrap();
        let g = a
            .register_file(FileSpec::new(&path, 4096, FileMode::CreateNew))
            .await
            .unwrap();
        assert_eq!(g.size(), 4096);
    });
    a.shutdown();
}

#[test]
fn an_agent_without_a_nic_exports_nothing_and_refuses_rdma() {
    let a = agent("no-nic");
    if a.has_nic() {
        eprintln!("SKIPPED an_agent_without_a_nic_exports_nothing_and_refuses_rdma: this machine has an RDMA device");
        a.shutdown();
        return;
    }
    let r = block_on(a.register(4096, Visibility::All)).unwrap();
    let md = a.local_metadata("peer").unwrap();
    let b = agent("reader");
    assert_eq!(b.load_remote_metadata(&md).unwrap(), "no-nic");
    let mut l = LocalDescList::new();
    l.push(r.region(), 0, 4096);
    // The NIC-less agent's host memory is not in its metadata: peers cannot address it.
    match block_on(b.read(
        "no-nic",
        &l,
        &[RemoteRef {
            region: r.id(),
            offset: 0,
            len: 4096,
        }],
    )) {
        Err(AgentError::UnknownRegion { .. }) => {}
        other => panic!("{other:?}"),
    }
    a.shutdown();
    b.shutdown();
}

#[test]
fn vram_registration_is_typed_without_a_gpu() {
    if rixl::gpudirect::cuda_available() {
        eprintln!("SKIPPED vram_registration_is_typed_without_a_gpu: a CUDA driver is present (scripts/gpu-check covers it)");
        return;
    }
    let a = agent("vram");
    match block_on(a.register_vram(0, 1 << 20, Visibility::All)) {
        Err(AgentError::Runtime(rixl::runtime::RuntimeError::Gpu(
            rixl::gpudirect::Error::NoCuda,
        ))) => {}
        other => panic!("{other:?}"),
    }
    a.shutdown();
}
