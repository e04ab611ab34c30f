use super::*;
use crate::wire::WcStatus;
use std::rc::Rc;

/// A fake completion source: completions queued as (wr_id, status), delivered in order.
#[derive(Default)]
struct FakeCq(std::collections::VecDeque<(u64, Result<(), TransferError>)>);

impl FakeCq {
    fn complete(&mut self, id: SlotId, signaled: bool) {
        self.0.push_back((id.wr_id(signaled), Ok(())));
    }
    fn fail(&mut self, id: SlotId, signaled: bool, status: WcStatus) {
        self.0
            .push_back((id.wr_id(signaled), Err(TransferError::from_status(status))));
    }
    fn drain<K>(&mut self, t: &mut InflightTable<K>) -> Vec<Routed> {
        self.0
            .drain(..)
            .map(|(w, s)| t.on_completion(w, s))
            .collect()
    }
}

use crate::harness::counting_waker as waker;

#[test]
fn wr_ids_round_trip() {
    for (k, g, s) in [(0, 1, true), (u32::MAX, GEN_MASK, false), (7, 12345, true)] {
        assert_eq!(decode_wr_id(encode_wr_id(k, g, s)), (k, g, s));
    }
}

#[test]
fn completes_after_the_last_signaled_request_and_wakes_once() {
    let mut t = InflightTable::new();
    let id = t.insert(0, ());
    t.add_signaled(id, 2);
    assert!(!t.end_posting(id));
    let (count, w) = waker();
    let mut cx = Context::from_waker(&w);
    assert!(t.poll(id, &mut cx).is_pending());
    let mut cq = FakeCq::default();
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Progress]);
    assert_eq!(count.get(), 0);
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
    assert_eq!(count.get(), 1);
    assert_eq!(t.poll(id, &mut cx), Poll::Ready(Ok(())));
    assert!(t.is_empty());
    assert_eq!(t.signaled_outstanding(), 0);
}

#[test]
fn try_take_registers_no_waker_so_reaping_ones_own_completion_wakes_nobody() {
    let mut t = InflightTable::new();
    let id = t.insert(0, ());
    t.add_signaled(id, 1);
    t.end_posting(id);
    assert!(t.try_take(id).is_pending());
    let (count, w) = waker();
    let mut cx = Context::from_waker(&w);
    let mut cq = FakeCq::default();
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
    assert_eq!(t.poll(id, &mut cx), Poll::Ready(Ok(())));
    assert_eq!(count.get(), 0, "no self-wake");
    assert!(t.is_empty());
    // A finished slot's result is taken once; the id is then gone.
    assert_eq!(t.try_take(id), Poll::Ready(Err(TransferError::EngineGone)));
}

#[test]
fn completions_while_still_posting_do_not_finish_early() {
    let mut t = InflightTable::new();
    let id = t.insert(0, ());
    t.add_signaled(id, 1);
    let mut cq = FakeCq::default();
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Progress]);
    t.add_signaled(id, 1);
    assert!(!t.end_posting(id));
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
}

#[test]
fn first_error_wins_over_the_flushes_that_follow() {
    let mut t = InflightTable::new();
    let id = t.insert(3, ());
    t.add_signaled(id, 3);
    t.end_posting(id);
    let mut cq = FakeCq::default();
    // An unsignaled request fails, then the signaled ones are flushed.
    cq.fail(id, false, WcStatus::RemoteAccessError);
    cq.fail(id, true, WcStatus::WorkRequestFlushError);
    cq.fail(id, true, WcStatus::WorkRequestFlushError);
    cq.fail(id, true, WcStatus::WorkRequestFlushError);
    let routed = cq.drain(&mut t);
    assert_eq!(routed.last(), Some(&Routed::Finished));
    let (_, w) = waker();
    let r = t.poll(id, &mut Context::from_waker(&w));
    assert_eq!(
        r,
        Poll::Ready(Err(TransferError::RemoteAccess {
            status: WcStatus::RemoteAccessError
        }))
    );
}

#[test]
fn a_dropped_future_keeps_memory_alive_until_the_nic_is_done() {
    let mut t = InflightTable::new();
    let region = Rc::new([0u8; 64]);
    let id = t.insert(0, Rc::clone(&region));
    t.add_signaled(id, 2);
    t.end_posting(id);
    assert!(!t.detach(id), "work outstanding: not released yet");
    assert_eq!(
        Rc::strong_count(&region),
        2,
        "the slot still holds the memory"
    );
    let mut cq = FakeCq::default();
    cq.complete(id, true);
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Progress, Routed::Released]);
    assert_eq!(
        Rc::strong_count(&region),
        1,
        "released after the last completion"
    );
    assert!(t.is_empty());
}

#[test]
fn a_forgotten_future_is_the_same_as_a_pending_slot_the_nic_completes() {
    // mem::forget of the future never runs its destructor: the slot stays attached, the
    // completion wakes a stale waker, and the memory is still released when the table is.
    let mut t = InflightTable::new();
    let region = Rc::new(1u8);
    let id = t.insert(0, Rc::clone(&region));
    t.add_signaled(id, 1);
    t.end_posting(id);
    let (_, w) = waker();
    assert!(t.poll(id, &mut Context::from_waker(&w)).is_pending());
    std::mem::forget(w);
    let mut cq = FakeCq::default();
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
    assert!(t.contains(id), "result parked until polled or detached");
    drop(t);
    assert_eq!(
        Rc::strong_count(&region),
        1,
        "dropping the table releases it"
    );
}

#[test]
fn detaching_while_posting_stops_posting_and_releases_when_drained() {
    let mut t = InflightTable::new();
    let id = t.insert(0, ());
    t.add_signaled(id, 1); // one chunk posted, more would have followed
    assert!(!t.detach(id));
    let mut cq = FakeCq::default();
    cq.complete(id, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Released]);
    // Detaching a slot with nothing outstanding releases at once.
    let id2 = t.insert(0, ());
    assert!(t.detach(id2));
    assert!(t.is_empty());
}

#[test]
fn an_expired_transfer_returns_at_once_but_keeps_its_memory_until_flushed() {
    let mut t = InflightTable::new();
    let region = Rc::new(0u8);
    let id = t.insert(0, Rc::clone(&region));
    t.add_signaled(id, 3);
    t.end_posting(id);
    let (count, w) = waker();
    let mut cx = Context::from_waker(&w);
    assert!(t.poll(id, &mut cx).is_pending());
    let err = TransferError::Timeout(std::time::Duration::from_millis(5));
    assert!(t.expire(id, err.clone()));
    assert_eq!(count.get(), 1, "the future is woken");
    assert!(!t.expire(id, err.clone()), "expiring twice does nothing");
    assert_eq!(t.poll(id, &mut cx), Poll::Ready(Err(err)));
    assert_eq!(
        Rc::strong_count(&region),
        2,
        "memory held while the NIC may touch it"
    );
    let mut cq = FakeCq::default();
    for _ in 0..3 {
        cq.fail(id, true, WcStatus::WorkRequestFlushError);
    }
    assert_eq!(cq.drain(&mut t).last(), Some(&Routed::Released));
    assert_eq!(Rc::strong_count(&region), 1);
    // A transfer that already finished cannot expire.
    let done = t.insert(0, Rc::clone(&region));
    t.end_posting(done);
    assert!(!t.expire(done, TransferError::Flushed));
}

#[test]
fn stale_generations_are_ignored_after_slot_reuse() {
    let mut t = InflightTable::new();
    let old = t.insert(0, ());
    assert!(t.detach(old));
    let new = t.insert(0, ());
    assert_eq!(old.key, new.key, "the slab reuses the key");
    assert_ne!(old.generation, new.generation);
    t.add_signaled(new, 1);
    t.end_posting(new);
    let mut cq = FakeCq::default();
    cq.complete(old, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Stale]);
    assert!(t.contains(new));
    assert_eq!(
        t.signaled_outstanding(),
        1,
        "a stale completion takes no credit"
    );
    cq.complete(new, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
}

#[test]
fn failing_a_connection_marks_only_its_transfers() {
    let mut t = InflightTable::new();
    let a = t.insert(1, ());
    let b = t.insert(2, ());
    for id in [a, b] {
        t.add_signaled(id, 1);
        t.end_posting(id);
    }
    t.fail_connection(
        1,
        &TransferError::Timeout(std::time::Duration::from_secs(1)),
    );
    let mut cq = FakeCq::default();
    cq.fail(a, true, WcStatus::WorkRequestFlushError);
    cq.complete(b, true);
    cq.drain(&mut t);
    let (_, w) = waker();
    let mut cx = Context::from_waker(&w);
    assert!(matches!(
        t.poll(a, &mut cx),
        Poll::Ready(Err(TransferError::Timeout(_)))
    ));
    assert_eq!(t.poll(b, &mut cx), Poll::Ready(Ok(())));
}

#[test]
fn covered_transfers_complete_with_the_signaled_one_after_them() {
    let mut t = InflightTable::new();
    // A and B posted unsignaled, C's (later) request signaled: one CQE completes all three.
    let (a, b, c) = (t.insert(0, ()), t.insert(0, ()), t.insert(0, ()));
    let (count, w) = waker();
    let mut cx = Context::from_waker(&w);
    for id in [a, b, c] {
        assert!(t.poll(id, &mut cx).is_pending());
    }
    t.add_signaled(c, 1);
    t.cover(c, a);
    t.cover(c, b);
    for id in [a, b, c] {
        t.finish_posting(id);
    }
    assert_eq!(count.get(), 0, "nothing completes before the CQE");
    assert_eq!(t.signaled_outstanding(), 1, "covers are not NIC work");
    let mut cq = FakeCq::default();
    cq.complete(c, true);
    assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
    assert_eq!(count.get(), 3, "C, then A and B, woken");
    for id in [a, b, c] {
        assert_eq!(t.poll(id, &mut cx), Poll::Ready(Ok(())));
    }
    assert!(t.is_empty());
}

#[test]
fn a_covered_transfer_keeps_its_own_error_and_a_detached_one_is_released() {
    let mut t = InflightTable::new();
    let (a, b, c) = (t.insert(0, ()), t.insert(0, ()), t.insert(0, ()));
    t.add_signaled(c, 1);
    t.cover(c, a);
    t.cover(c, b);
    for id in [a, b, c] {
        t.finish_posting(id);
    }
    // B's future went away: its slot (and keep-alive) stays until C's completion.
    assert!(!t.detach(b));
    assert!(t.contains(b));
    // A's unsignaled request fails (errors always complete); C is flushed.
    let mut cq = FakeCq::default();
    cq.fail(a, false, WcStatus::RemoteAccessError);
    cq.fail(c, true, WcStatus::WorkRequestFlushError);
    cq.drain(&mut t);
    assert!(!t.contains(b), "detached and covered: released with C");
    let (_, w) = waker();
    let mut cx = Context::from_waker(&w);
    assert!(matches!(
        t.poll(a, &mut cx),
        Poll::Ready(Err(TransferError::RemoteAccess { .. }))
    ));
    assert_eq!(t.poll(c, &mut cx), Poll::Ready(Err(TransferError::Flushed)));
    assert!(t.is_empty());
}

#[test]
fn covering_by_a_finished_or_unknown_slot_is_a_no_op() {
    let mut t = InflightTable::new();
    let a = t.insert(0, ());
    let gone = t.insert(0, ());
    t.finish_posting(gone);
    let (_, w) = waker();
    let mut cx = Context::from_waker(&w);
    assert_eq!(t.poll(gone, &mut cx), Poll::Ready(Ok(())));
    t.cover(gone, a);
    t.finish_posting(a);
    assert_eq!(t.poll(a, &mut cx), Poll::Ready(Ok(())));
}
