//! Micro-benchmarks of the transfer core; they run on any machine (no RDMA): the whole software
//! path of a transfer to a null queue pair (planning, slot, credits, work-request building into
//! a real verbs batch, completion routing and the result), descriptor validation and splitting
//! into work requests, the in-flight table, completion routing, send-queue credit planning, and
//! endpoint encode/decode (the connection part of metadata).

use std::hint::black_box;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use rixl_proto::credits::SendCredits;
use rixl_proto::inflight::InflightTable;
use rixl_proto::plan::{plan, Limits};
use rixl_proto::{Completion, Core, LocalDesc, Op, RegionInfo, RemoteDesc, TransferOptions};
use rixl_verbs::{Endpoint, Gid, Mtu};

#[path = "core/null_nic.rs"]
mod null_nic;
#[path = "core/stages.rs"]
mod stages;

use null_nic::{connected_core, NullCq, NullNic, NullQp};

const REGION: RegionInfo = RegionInfo {
    addr: 0x7f00_0000_0000,
    len: 1 << 30,
    lkey: 0x1234,
    host: true,
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

/// One WRITE through the core, as the engine's transfer future runs it: plan into a kept plan,
/// open a slot, post as credits allow (reaping when they run out), recycle the plan, take the
/// result. Returns the work requests posted.
fn null_transfer(
    core: &mut Core<NullQp<Rc<()>>>,
    cq: &mut NullCq<'_>,
    conn: rixl_proto::ConnId,
    keep: &Rc<()>,
    local: &[LocalDesc],
    remote: &[RemoteDesc],
) -> usize {
    let mut cx = Context::from_waker(Waker::noop());
    let mut buf = [Completion::success(0, 0); 32];
    let mut plan = core.take_plan();
    core.plan_transfer(conn, Op::Write, &[REGION], local, remote, false, &mut plan)
        .expect("valid lists");
    let mut p = core.begin(
        conn,
        Op::Write,
        Rc::clone(keep),
        &TransferOptions::default(),
    );
    while core.post(&mut p, &plan, &mut cx).is_pending() {
        core.reap(cq, &mut buf);
    }
    // Queued for a coalesced post (the engine's flush task): a transfer after transfer loop
    // like this one soon posts at once, but for a probe every COALESCE_PROBE_EVERY.
    if p.queued() && core.take_flush_request(conn) {
        while core.flush(conn, &mut cx).is_pending() {
            core.reap(cq, &mut buf);
        }
    }
    let wrs = plan.wrs.len();
    core.recycle_plan(plan);
    loop {
        if let Poll::Ready(r) = core.try_finish(&mut p) {
            r.expect("null QP completes successfully");
            return wrs;
        }
        core.reap(cq, &mut buf);
        if let Poll::Ready(r) = core.poll_finish(&mut p, &mut cx) {
            r.expect("null QP completes successfully");
            return wrs;
        }
    }
}

/// The software path of one transfer of N scattered 4 KiB descriptors on one core, NIC taken
/// out: descriptors per second. The goal at 4,096 is 20 M/s (a 400 Gb/s NIC takes about 12 M
/// 4 KiB writes per second).
fn bench_null_qp(c: &mut Criterion) {
    let mut g = c.benchmark_group("null_qp_write");
    let nic = NullNic::completing_at_doorbell();
    let (mut core, conn) = connected_core(&nic);
    let mut null_cq = NullCq(&nic);
    let keep = Rc::new(());
    for n in [1u64, 64, 4096, 100_000] {
        let (local, remote) = scattered(n, 4096);
        assert_eq!(
            null_transfer(&mut core, &mut null_cq, conn, &keep, &local, &remote),
            n as usize,
            "one work request per scattered descriptor"
        );
        g.throughput(Throughput::Elements(n));
        g.bench_with_input(BenchmarkId::new("scattered_4KiB", n), &n, |b, _| {
            b.iter(|| null_transfer(&mut core, &mut null_cq, conn, &keep, &local, &remote))
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_null_qp,
    stages::bench_null_qp_await,
    bench_plan,
    bench_inflight,
    bench_credits,
    bench_endpoint
);
fn main() {
    benches();
    // The stage table runs with a `null_qp` filter or none; with criterion's test mode (no
    // `--bench`: `cargo test --benches`) on fewer transfers.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filter = args.iter().find(|a| !a.starts_with('-'));
    if filter.is_none_or(|f| "null_qp_stages".contains(f.as_str())) {
        let n = if args.iter().any(|a| a == "--bench") {
            200_000
        } else {
            2_000
        };
        stages::print_stage_table(n);
    }
    Criterion::default().configure_from_args().final_summary();
}
