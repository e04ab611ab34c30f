//! Grants enforced by the NIC (`grant_`): type-2 memory windows on a real device (rxe in the
//! guest: `scripts/rdma-suite grant_`). One process: a "server" protection domain whose region
//! is reachable only through windows, and client queue pairs connected to it on the same device
//! (rxe loops same-device traffic through its wire path, so every access is checked by the
//! responder exactly as between hosts). On a host without RDMA every test prints why it is
//! skipped.

mod common;

use std::time::{Duration, Instant};

use common::{connect_options, device_or_skip, fill};
use rixl_verbs::{
    AccessFlags, CompletionQueue, Context, MemoryWindow, ProtectionDomain, QueuePair,
    QueuePairCapabilities, RegisteredBuffer, SendBatch, SendFlags, SendOp, Sge, WcStatus,
    WorkCompletion,
};

const LEN: usize = 64 << 10;
const TIMEOUT: Duration = Duration::from_secs(30);

/// One side of a connection: its queue pair and its completion queue.
struct End {
    qp: QueuePair,
    cq: CompletionQueue,
}

impl End {
    fn new(ctx: &Context, pd: &ProtectionDomain) -> End {
        let cq = CompletionQueue::new(ctx, 64, false).expect("cq");
        let mut caps = QueuePairCapabilities::default();
        caps.max_send_wr = 16;
        caps.max_recv_wr = 4;
        let qp = QueuePair::new_rc(pd, &cq, &cq, caps).expect("qp");
        End { qp, cq }
    }

    /// Polls one completion.
    fn wait(&self) -> WorkCompletion {
        let t0 = Instant::now();
        let mut wc = [WorkCompletion::default(); 1];
        loop {
            if self.cq.poll(&mut wc).expect("poll") == 1 {
                return wc[0];
            }
            assert!(t0.elapsed() < TIMEOUT, "no completion in {TIMEOUT:?}");
            std::thread::yield_now();
        }
    }
}

/// A connected pair: the server's end (in the server's PD) and a client's (in its own PD).
fn connect(
    ctx: &Context,
    server_pd: &ProtectionDomain,
    client_pd: &ProtectionDomain,
) -> (End, End) {
    let (s, c) = (End::new(ctx, server_pd), End::new(ctx, client_pd));
    let opts = connect_options();
    let (sp, cp) = (0x1000, 0x2000);
    let se = s.qp.endpoint(&opts, sp).expect("endpoint");
    let ce = c.qp.endpoint(&opts, cp).expect("endpoint");
    s.qp.connect(&ce, sp, &opts).expect("connect server end");
    c.qp.connect(&se, cp, &opts).expect("connect client end");
    (s, c)
}

/// The server: a region registered for window binding only (no remote access of its own).
struct Server {
    ctx: Context,
    pd: ProtectionDomain,
    buf: RegisteredBuffer,
    client_pd: ProtectionDomain,
    local: RegisteredBuffer,
}

impl Server {
    fn open(test: &str) -> Option<Server> {
        let ctx = device_or_skip(test)?;
        let pd = ProtectionDomain::new(&ctx).expect("pd");
        let mut buf =
            RegisteredBuffer::new(&pd, LEN, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)
                .expect("a region for window binding (IBV_ACCESS_MW_BIND)");
        fill(buf.as_mut_slice(), 1);
        let client_pd = ProtectionDomain::new(&ctx).expect("pd");
        let local = RegisteredBuffer::new(&client_pd, LEN, AccessFlags::ALL_RDMA).expect("local");
        Some(Server {
            ctx,
            pd,
            buf,
            client_pd,
            local,
        })
    }

    fn connect(&self) -> (End, End) {
        connect(&self.ctx, &self.pd, &self.client_pd)
    }

    /// Binds `window` over the whole region on `end`, with `access`; the rkey and how long the
    /// bind took to complete.
    fn bind(&self, end: &End, window: &mut MemoryWindow, access: AccessFlags) -> (u32, Duration) {
        let t0 = Instant::now();
        // SAFETY: `self.buf` outlives every window of these tests (windows are dropped first,
        // at the end of each test, and the server last).
        let rkey = unsafe {
            end.qp.post_bind_window(
                window,
                self.buf.region(),
                self.buf.addr(),
                LEN as u64,
                access,
                7,
            )
        }
        .expect("post the bind");
        let wc = end.wait();
        let took = t0.elapsed();
        wc.result().expect("the bind completed");
        assert_eq!(wc.wr_id(), 7);
        (rkey, took)
    }

    /// One signaled `op` of `len` bytes from/to the client's local buffer at offset 0; its
    /// completion status.
    fn access(&self, client: &End, op: SendOp, len: u32) -> WcStatus {
        let mut b = SendBatch::default();
        b.push(
            1,
            op,
            &[Sge {
                addr: self.local.addr(),
                length: len,
                lkey: self.local.lkey(),
            }],
            SendFlags::SIGNALED,
        );
        client
            .qp
            .post_send_in(&mut b, std::slice::from_ref(&self.local))
            .expect("post");
        client.wait().status()
    }

    fn read(&self, client: &End, rkey: u32) -> WcStatus {
        self.access(
            client,
            SendOp::Read {
                remote_addr: self.buf.addr(),
                rkey,
            },
            4096,
        )
    }

    fn write(&self, client: &End, rkey: u32) -> WcStatus {
        self.access(
            client,
            SendOp::Write {
                remote_addr: self.buf.addr(),
                rkey,
            },
            4096,
        )
    }
}

#[test]
fn grant_a_window_works_only_on_the_queue_pair_it_is_bound_to() {
    let Some(mut s) = Server::open("grant_a_window_works_only_on_the_queue_pair_it_is_bound_to")
    else {
        return;
    };
    let (a_srv, a_cli) = s.connect();
    let (_b_srv, b_cli) = s.connect();
    let mut window = MemoryWindow::new(&s.pd).expect("a type-2 memory window");
    let (rkey, bind_took) = s.bind(
        &a_srv,
        &mut window,
        AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
    );
    // A, the grantee: reads the region and writes its first 4 KiB.
    assert_eq!(s.read(&a_cli, rkey), WcStatus::Success, "the grantee reads");
    assert!(s.local.as_slice()[..4096] == s.buf.as_slice()[..4096]);
    fill(&mut s.local.as_mut_slice()[..4096], 2);
    assert_eq!(
        s.write(&a_cli, rkey),
        WcStatus::Success,
        "the grantee writes"
    );
    assert!(s.buf.as_slice()[..4096] == s.local.as_slice()[..4096]);
    let before = s.buf.as_slice().to_vec();
    // B: the right address and A's rkey, on its own queue pair.
    fill(&mut s.local.as_mut_slice()[..4096], 3);
    let b_write = s.write(&b_cli, rkey);
    assert_eq!(
        b_write,
        WcStatus::RemoteAccessError,
        "another queue pair writes with A's rkey"
    );
    assert!(
        s.buf.as_slice() == before.as_slice(),
        "the region is unchanged"
    );
    // The region's own rkey grants nothing either: it was registered without remote access.
    let (_c_srv, c_cli) = s.connect();
    let mr_read = s.read(&c_cli, s.buf.region().rkey());
    assert_eq!(
        mr_read,
        WcStatus::RemoteAccessError,
        "the region's own rkey"
    );
    rixl_testkit::report(&format!(
        "grant: window bound in {bind_took:?}; grantee READ/WRITE ok; another QP's WRITE with the grantee's rkey: {b_write}; the MR's rkey: {mr_read}; region unchanged"
    ));
    drop(window);
}

#[test]
fn grant_a_read_only_window_refuses_writes() {
    let Some(mut s) = Server::open("grant_a_read_only_window_refuses_writes") else {
        return;
    };
    let (srv, cli) = s.connect();
    let mut window = MemoryWindow::new(&s.pd).expect("a type-2 memory window");
    let (rkey, _) = s.bind(&srv, &mut window, AccessFlags::REMOTE_READ);
    assert_eq!(
        s.read(&cli, rkey),
        WcStatus::Success,
        "a read-only grant reads"
    );
    let before = s.buf.as_slice().to_vec();
    fill(&mut s.local.as_mut_slice()[..4096], 9);
    let w = s.write(&cli, rkey);
    assert_eq!(
        w,
        WcStatus::RemoteAccessError,
        "a WRITE through a read-only grant"
    );
    assert!(
        s.buf.as_slice() == before.as_slice(),
        "the region is unchanged"
    );
    rixl_testkit::report(&format!("grant: read-only window, WRITE completed {w}"));
    drop(window);
}

#[test]
fn grant_invalidating_a_window_revokes_it_at_once_and_a_rebind_takes_a_new_key() {
    let Some(s) = Server::open("grant_invalidating_a_window_revokes_it_at_once") else {
        return;
    };
    let (srv, cli) = s.connect();
    let mut window = MemoryWindow::new(&s.pd).expect("a type-2 memory window");
    let (old, _) = s.bind(&srv, &mut window, AccessFlags::REMOTE_READ);
    assert_eq!(s.read(&cli, old), WcStatus::Success);
    let t0 = Instant::now();
    srv.qp
        .post_invalidate(old, 8)
        .expect("post the invalidation");
    let wc = srv.wait();
    let inv_took = t0.elapsed();
    wc.result().expect("the invalidation completed");
    let revoked = s.read(&cli, old);
    assert_eq!(
        revoked,
        WcStatus::RemoteAccessError,
        "a read after the invalidation"
    );
    // A new grant on a new connection: a new key; the old one still grants nothing.
    let (srv2, cli2) = s.connect();
    let (new, _) = s.bind(&srv2, &mut window, AccessFlags::REMOTE_READ);
    assert_ne!(new, old, "a re-bind takes a new key");
    assert_eq!(s.read(&cli2, new), WcStatus::Success, "the new grant reads");
    let (_srv3, cli3) = s.connect();
    assert_eq!(
        s.read(&cli3, old),
        WcStatus::RemoteAccessError,
        "the old key, elsewhere"
    );
    // What a grant and its revocation cost on one queue pair: a type-2 window is bound, then
    // invalidated before it may be bound again.
    let (srv4, _cli4) = s.connect();
    let mut w4 = MemoryWindow::new(&s.pd).expect("window");
    let n = 200u32;
    let t0 = Instant::now();
    for _ in 0..n {
        let (k, _) = s.bind(&srv4, &mut w4, AccessFlags::REMOTE_READ);
        srv4.qp
            .post_invalidate(k, 9)
            .expect("post the invalidation");
        srv4.wait().result().expect("invalidated");
    }
    let per = t0.elapsed() / n;
    rixl_testkit::report(&format!(
        "grant: invalidation completed in {inv_took:?}, then READ {revoked}; re-bind key {new:#x} (was {old:#x}); {n} bind+invalidate pairs, {per:?} each"
    ));
    // A window bound on a queue pair holds a reference to it: destroying the queue pair first
    // (locals drop in reverse order, and `srv2` came after `window`) makes rxe's destroy wait
    // about 50 s for that reference before it warns and goes on. (rixl's `BoundWindow` keeps
    // its queue pair and is deallocated first.)
    drop(window);
    drop(w4);
}
