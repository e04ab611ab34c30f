//! Micro-benchmarks of the runtime's pure hot-path logic; they run on any machine (no RDMA):
//! descriptor validation and splitting into work requests, the in-flight table (insert and
//! complete), completion routing from a fake completion source, send-queue credit planning, and
//! endpoint encode/decode (the connection part of metadata).

use std::hint::black_box;
use std::task::{Context, Waker};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rixl::runtime::credits::SendCredits;
use rixl::runtime::inflight::InflightTable;
use rixl::runtime::plan::{plan, Limits, RegionInfo};
use rixl::runtime::{LocalDesc, RemoteDesc};
use rixl::verbs::{Endpoint, Gid, Mtu};

const REGION: RegionInfo = RegionInfo {
    addr: 0x7f00_0000_0000,
    len: 1 << 30,
    lkey: 0x1234,
};

fn scattered(n: u64, block: u64) -> (Vec<LocalDesc>, Vec<RemoteDesc>) {
    let local = (0..n)
        .map(|i| LocalDesc {
            region: 0,
            offset: ((i * 7919) % 131_072) * 4096,
            len: block,
        })
        .collect();
    let remote = (0..n)
        .map(|i| RemoteDesc {
            addr: 0x5500_0000_0000 + ((i * 104_729) % 131_072) * 4096,
            len: block,
            rkey: 77,
        })
        .collect();
    (local, remote)
}

fn bench_plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan");
    let limits = Limits {
        max_sge: 16,
        max_msg: 1 << 31,
    };
    for n in [1u64, 100, 10_000, 100_000] {
        let (local, remote) = scattered(n, 4096);
        g.throughput(Throughput::Elements(n));
        g.bench_with_input(BenchmarkId::new("scattered_4KiB", n), &n, |b, _| {
            b.iter(|| {
                plan(&[REGION], black_box(&local), black_box(&remote), limits).expect("valid")
            })
        });
    }
    // Contiguous blocks merge into few requests.
    let local: Vec<LocalDesc> = (0..10_000)
        .map(|i| LocalDesc {
            region: 0,
            offset: i * 4096,
            len: 4096,
        })
        .collect();
    let remote: Vec<RemoteDesc> = (0..10_000)
        .map(|i| RemoteDesc {
            addr: 0x5500_0000_0000 + i * 4096,
            len: 4096,
            rkey: 77,
        })
        .collect();
    g.throughput(Throughput::Elements(10_000));
    g.bench_function("contiguous_4KiB/10000", |b| {
        b.iter(|| plan(&[REGION], black_box(&local), black_box(&remote), limits).expect("valid"))
    });
    g.finish();
}

fn bench_inflight(c: &mut Criterion) {
    let mut g = c.benchmark_group("inflight");
    g.throughput(Throughput::Elements(1));
    g.bench_function("insert_post_complete_poll", |b| {
        let mut t: InflightTable<()> = InflightTable::new();
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        b.iter(|| {
            let id = t.insert(0, ());
            t.add_signaled(id, 1);
            t.end_posting(id);
            t.on_completion(id.wr_id(true), Ok(()));
            black_box(t.poll(id, &mut cx))
        })
    });
    // Routing a batch of 32 completions across 1024 live transfers (a fake completion source).
    g.throughput(Throughput::Elements(32));
    g.bench_function("route_32_of_1024_live", |b| {
        let mut t: InflightTable<()> = InflightTable::new();
        let ids: Vec<_> = (0..1024)
            .map(|_| {
                let id = t.insert(0, ());
                t.add_signaled(id, u32::MAX / 2);
                t.end_posting(id);
                id
            })
            .collect();
        let mut k = 0usize;
        b.iter(|| {
            for _ in 0..32 {
                k = (k + 97) % ids.len();
                black_box(t.on_completion(ids[k].wr_id(true), Ok(())));
            }
        })
    });
    g.finish();
}

fn bench_credits(c: &mut Criterion) {
    let mut g = c.benchmark_group("credits");
    g.throughput(Throughput::Elements(64));
    g.bench_function("plan_commit_complete_64", |b| {
        let mut cr = SendCredits::new(1024, 32);
        b.iter(|| {
            let p = cr.plan(64);
            black_box(p.signaled());
            cr.commit(p);
            for _ in 0..2 {
                cr.on_signaled_completion();
            }
        })
    });
    g.finish();
}

fn bench_endpoint(c: &mut Criterion) {
    let ep = Endpoint {
        qpn: 0x1234,
        psn: 0xabcdef,
        lid: 0,
        gid: Gid([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 1]),
        mtu: Mtu::Mtu4096,
    };
    let mut g = c.benchmark_group("metadata");
    g.bench_function("endpoint_encode_decode", |b| {
        b.iter(|| Endpoint::from_bytes(&black_box(ep).to_bytes()).expect("valid"))
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_plan,
    bench_inflight,
    bench_credits,
    bench_endpoint
);
criterion_main!(benches);
