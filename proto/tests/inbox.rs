//! The inbox against the fake NIC: payloads wait in their receive buffers for the reader (no
//! copy) up to half the ring, are copied on arrival past that, keep their order either way, and
//! every buffer is posted again exactly once, when its reader is done with it.

use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use rixl_proto::harness::{FakeCq, FakeNic, FakeQueue};
use rixl_proto::{
    recv_wr_id, Completion, ConnId, ConnParams, Core, CoreConfig, Delivery, HeldBuffer, Message,
    Received, SendQueue, TransferError, WcOpcode, WcStatus,
};

type Keep = Rc<&'static str>;

/// Receive buffers per connection: half of them (4) may hold payloads.
const RING: u32 = 8;

struct Fx {
    nic: FakeNic,
    cq: FakeCq,
    core: Core<FakeQueue<Keep>>,
    conn: ConnId,
}

impl Fx {
    fn new() -> Self {
        let nic = FakeNic::new();
        let mut core = Core::new(CoreConfig::default());
        let conn = core.add_connection(nic.queue(), params());
        assert!(core.connected(conn, 1 << 20));
        // A reader that borrows payloads (as `recv_with`): arriving ones may wait in their buffers.
        assert!(core.take_delivery(conn, None).is_pending());
        Fx {
            cq: nic.cq(),
            nic,
            core,
            conn,
        }
    }

    fn qpn(&self) -> u32 {
        self.core.queue(self.conn).expect("connection").qpn()
    }

    /// Receives `len` bytes into buffer `index` (the fake NIC's buffer `i` holds bytes `i`).
    fn arrive(&mut self, index: u32, len: u32, imm: Option<u32>) {
        self.arrive_on(self.qpn(), index, len, imm);
    }

    /// As [`Self::arrive`], the completion naming queue pair `qpn`.
    fn arrive_on(&mut self, qpn: u32, index: u32, len: u32, imm: Option<u32>) {
        self.nic.inject(Completion {
            wr_id: recv_wr_id(self.conn.0, index),
            status: WcStatus::Success,
            opcode: WcOpcode::Recv,
            byte_len: len,
            imm,
            qp_num: qpn,
        });
        self.reap();
    }

    fn reap(&mut self) {
        let mut buf = [Completion::success(0, 0); 16];
        while self.core.reap(&mut self.cq, &mut buf) > 0 {}
    }

    fn take(&mut self) -> Delivery {
        match self.core.take_delivery(self.conn, None) {
            Poll::Ready(Ok(d)) => d,
            other => panic!("expected a delivery, got {other:?}"),
        }
    }

    fn held(&mut self) -> HeldBuffer {
        match self.take() {
            Delivery::Held(h) => h,
            other => panic!("expected a held payload, got {other:?}"),
        }
    }

    fn reposted(&self) -> Vec<u32> {
        self.nic
            .reposted()
            .iter()
            .map(|id| (id & 0xffff) as u32)
            .collect()
    }

    /// Buffers read (copied) so far.
    fn copied(&self) -> Vec<u32> {
        self.nic.received().iter().map(|(i, _)| *i).collect()
    }
}

fn params() -> ConnParams {
    ConnParams {
        send_queue_depth: 16,
        max_send_sge: 4,
        max_inline: 64,
        recv_buffers: RING,
    }
}

#[test]
fn inbox_a_payload_waits_in_its_buffer_uncopied_until_its_reader_releases_it() {
    let mut fx = Fx::new();
    fx.arrive(3, 5, Some(9));
    assert!(
        fx.reposted().is_empty(),
        "not posted again while it holds the payload"
    );
    let h = fx.held();
    assert_eq!(
        (h.index(), h.len(), h.imm(), h.conn()),
        (3, 5, Some(9), fx.conn)
    );
    assert!(fx.reposted().is_empty(), "lent: still not posted");
    fx.core.release_received(h);
    assert_eq!(fx.reposted(), [3], "posted again once released");
    assert!(fx.copied().is_empty(), "the core copied nothing");
    assert!(fx.core.try_recv(fx.conn).is_pending());
}

#[test]
fn inbox_recv_copies_a_held_payload_out_and_posts_its_buffer_again() {
    let mut fx = Fx::new();
    fx.arrive(2, 7, None);
    assert_eq!(
        fx.core.try_recv(fx.conn),
        Poll::Ready(Ok(Message::Data(vec![2; 7], None)))
    );
    assert_eq!(fx.copied(), [2]);
    assert_eq!(fx.reposted(), [2]);
}

#[test]
fn inbox_past_half_the_ring_payloads_are_copied_on_arrival_and_order_is_kept() {
    let mut fx = Fx::new();
    for i in 0..6 {
        fx.arrive(i, 10 + i, Some(i));
    }
    // Buffers 0-3 hold their payloads; 4 and 5 were copied and posted again at once.
    assert_eq!(fx.copied(), [4, 5]);
    assert_eq!(fx.reposted(), [4, 5]);
    let mut order = Vec::new();
    let mut lent = Vec::new();
    for _ in 0..6 {
        match fx.take() {
            Delivery::Held(h) => {
                order.push(h.imm().unwrap());
                lent.push(h);
            }
            Delivery::Message(m) => {
                let Message::Data(bytes, imm) = m else {
                    panic!("unexpected {m:?}")
                };
                let i = imm.unwrap();
                assert_eq!(bytes, vec![i as u8; 10 + i as usize], "copy of buffer {i}");
                order.push(i);
            }
        }
    }
    assert_eq!(order, [0, 1, 2, 3, 4, 5], "arrival order");
    // The ring is full of held buffers until they come back: the next payload is copied.
    fx.arrive(6, 1, None);
    assert_eq!(fx.copied(), [4, 5, 6]);
    for h in lent.drain(..) {
        fx.core.release_received(h);
    }
    fx.arrive(7, 1, None);
    assert_eq!(fx.copied(), [4, 5, 6], "held again after the releases");
    assert!(matches!(fx.take(), Delivery::Message(_)));
    let h = fx.held();
    assert_eq!(h.index(), 7);
    fx.core.release_received(h);
    let mut all = fx.reposted();
    all.sort_unstable();
    assert_eq!(
        all,
        [0, 1, 2, 3, 4, 5, 6, 7],
        "each buffer posted again once"
    );
}

#[test]
fn inbox_an_immediate_reads_no_buffer_and_is_posted_again_at_once() {
    let mut fx = Fx::new();
    fx.nic.inject(Completion {
        wr_id: recv_wr_id(fx.conn.0, 1),
        status: WcStatus::Success,
        opcode: WcOpcode::RecvRdmaWithImm,
        byte_len: 0,
        imm: Some(77),
        qp_num: fx.qpn(),
    });
    fx.reap();
    assert_eq!(fx.reposted(), [1]);
    assert_eq!(fx.take(), Delivery::Message(Message::Immediate(77)));
    assert!(fx.copied().is_empty());
}

#[test]
fn inbox_a_failed_connection_delivers_its_held_payloads_then_its_error() {
    let mut fx = Fx::new();
    fx.arrive(0, 3, None);
    fx.arrive(1, 4, None);
    let first = fx.held();
    fx.core
        .fail_connection(fx.conn, "peer gone", &TransferError::Flushed);
    // Its payloads are still there (a held buffer is not posted, so nothing flushes it).
    let second = fx.held();
    assert_eq!((first.index(), second.index()), (0, 1));
    fx.core.release_received(first);
    fx.core.release_received(second);
    assert!(
        fx.reposted().is_empty(),
        "nothing posted to a failed queue pair"
    );
    assert!(matches!(
        fx.core.take_delivery(fx.conn, None),
        Poll::Ready(Err(TransferError::Connection(_, _)))
    ));
}

#[test]
fn inbox_a_buffer_released_after_its_connection_was_replaced_is_ignored() {
    let mut fx = Fx::new();
    let old_qpn = fx.qpn();
    fx.arrive(5, 8, None);
    let old = fx.held();
    assert!(fx.core.remove_connection(fx.conn).is_some());
    // The new connection takes the same slot (a new epoch).
    let conn = fx.core.add_connection(fx.nic.queue(), params());
    assert_eq!(conn, fx.conn);
    fx.core.release_received(old);
    assert!(
        fx.reposted().is_empty(),
        "the old buffer is not posted on the new queue pair"
    );
    assert!(fx.core.connected(conn, 1 << 20));
    assert!(fx.core.take_delivery(conn, None).is_pending());
    // A late receive completion of the old queue pair is not the new connection's.
    let stale = fx.core.counters().stale_completions;
    fx.arrive_on(old_qpn, 6, 8, None);
    assert!(fx.core.take_delivery(conn, None).is_pending());
    assert_eq!(fx.core.counters().stale_completions, stale + 1);
    assert!(fx.reposted().is_empty() && fx.copied().is_empty());
    // The new connection holds its own payloads from the start.
    for i in 0..RING / 2 {
        fx.arrive(i, 1, None);
    }
    assert!(
        fx.copied().is_empty(),
        "the old lent buffer did not count against it"
    );
}

#[test]
fn inbox_a_reader_waiting_is_woken_by_a_held_payload() {
    let mut fx = Fx::new();
    let (count, waker) = rixl_proto::harness::counting_waker();
    assert!(fx
        .core
        .take_delivery(fx.conn, Some(&mut Context::from_waker(&waker)))
        .is_pending());
    fx.arrive(4, 2, None);
    assert_eq!(count.get(), 1);
    let h = fx.held();
    // A borrowed view of a copied message reads the same as the held one's bytes would.
    let m = Message::Data(vec![4; 2], None);
    assert_eq!(Received::from(&m).to_message(), m);
    fx.core.release_received(h);
    assert!(fx
        .core
        .take_delivery(fx.conn, Some(&mut Context::from_waker(Waker::noop())))
        .is_pending());
}

#[test]
fn inbox_a_copying_reader_gets_payloads_copied_on_arrival_and_the_ring_stays_posted() {
    let mut fx = Fx::new();
    // The reader copies (`recv`): from its first take on, nothing is held.
    assert!(fx.core.try_recv(fx.conn).is_pending());
    for i in 0..RING {
        fx.arrive(i, 3, None);
    }
    assert_eq!(fx.copied(), (0..RING).collect::<Vec<_>>());
    assert_eq!(
        fx.reposted(),
        (0..RING).collect::<Vec<_>>(),
        "every buffer posted again at once"
    );
    for i in 0..RING {
        assert_eq!(
            fx.core.try_recv(fx.conn),
            Poll::Ready(Ok(Message::Data(vec![i as u8; 3], None)))
        );
    }
    // Borrowing again: payloads wait in their buffers again.
    assert!(fx.core.take_delivery(fx.conn, None).is_pending());
    fx.arrive(1, 2, None);
    let h = fx.held();
    assert_eq!(h.index(), 1);
    fx.core.release_received(h);
}
