//! The lone transfer: one descriptor a side that fits one request, on a ready connection. It is
//! most small transfers: a request-response loop's hop, posted at once with its own doorbell
//! when the connection has a send credit and would not coalesce it, or one of many concurrent
//! small transfers, queued for the connection's coalesced post. Either takes one call into the
//! core (the checks, the in-flight slot, and the post or the queueing) with no plan in between.
//! Anything else (errors included) is left to the general path ([`Core::plan_transfer`],
//! [`Core::begin`], [`Core::post`]), which does the same for these cases and names the errors.

use crate::conn::QueuedWr;
use crate::core::{fits_one_request, Core};
use crate::desc::{LocalDesc, Op, RegionInfo, RemoteDesc};
use crate::error::TransferError;
use crate::posting::{post_one_signaled, request_op, Posting};
use crate::queue::SendQueue;
use crate::stats::{ConnId, TransferOptions};
use crate::wire::{SendFlags, Sge};

/// A READ or WRITE of one local descriptor (of the list's first region, `region`) to or from one
/// remote descriptor.
#[derive(Debug, Clone, Copy)]
pub struct LoneTransfer<'a> {
    /// The connection.
    pub conn: ConnId,
    /// READ or WRITE.
    pub op: Op,
    /// The local region (checked to be this engine's and registered).
    pub region: RegionInfo,
    /// The local descriptor.
    pub local: &'a LocalDesc,
    /// The remote descriptor.
    pub remote: &'a RemoteDesc,
    /// Its options.
    pub opts: &'a TransferOptions,
}

impl<Q: SendQueue> Core<Q> {
    /// Posts `t` as one signaled request with its own doorbell, in a new in-flight slot keeping
    /// what `keep` makes alive, if it is valid, fits one request, its connection is ready with
    /// a free send credit, and coalescing would post it at once (the first transfer of its
    /// turn, or coalescing off). If coalescing would queue it instead, queues it (one request)
    /// for the connection's flush ([`Posting::queued`]: the caller schedules the flush with
    /// [`Core::take_flush_request`], as after [`Core::post`]). The posting ends here (queued:
    /// at the flush); wait for it with [`Core::try_finish`] / [`Core::poll_finish`], as for any
    /// other.
    ///
    /// `None` (nothing changed, `keep` not called) for anything else: post it with the general
    /// path, which plans, waits for credits or names the error. A post the queue refuses is the
    /// transfer's result and fails the connection, as on the general path.
    ///
    /// Inlined into its callers (a transfer and a prepared transfer's post): it is the latency
    /// path, and out of line it cost a lone WRITE's hop about 50 instructions more (icount).
    #[inline(always)]
    pub fn post_lone(
        &mut self,
        t: &LoneTransfer<'_>,
        keep: impl FnOnce() -> Q::Keep,
    ) -> Option<Posting> {
        if t.opts.notify_imm.is_some() && t.op == Op::Read {
            return None;
        }
        let turn = self.turn;
        let coalesce = self.cfg.coalesce;
        let c = self.conns.get_mut(t.conn.0 as usize)?;
        if c.check_ready(t.conn.0).is_err()
            || !fits_one_request(c.max_msg, &t.region, t.local, t.remote)
        {
            return None;
        }
        let sge = Sge {
            addr: t.region.addr + t.local.offset,
            length: t.local.len as u32,
            lkey: t.region.lkey,
        };
        // Decided without counting: a transfer declined here is counted once, by the general
        // path's decision.
        let queue = coalesce && !c.posts_at_once(turn);
        if !queue && c.credits.available() == 0 {
            return None;
        }
        if coalesce {
            // Recorded as `posts_at_once` said: queued, or posted at once (taking the turn).
            c.decide_turn(turn);
        }
        let slot = self.inflight.insert(t.conn.0, keep());
        let mut p = Posting::lone(t.conn, t.op, slot, t.opts, self.cfg.transfer_timeout);
        let op = request_op(&p, t.remote.addr, t.remote.rkey, true);
        if queue {
            // For the turn's flush, as the general path queues it (`Core::enqueue`, whose
            // lookup and readiness check this call has done already: about 70 instructions a
            // queued transfer under icount).
            c.pending
                .push_back(QueuedWr::single(slot, op, sge, t.region.host));
            self.counters.queued += 1;
            p.set_queued();
            return Some(p);
        }
        let bytes = t.local.len;
        let flags = SendFlags {
            inline: t.region.host && c.inline(&op, bytes),
            ..SendFlags::SIGNALED
        };
        let posted = post_one_signaled(
            c,
            &mut self.inflight,
            &mut self.counters,
            slot,
            |q, wr_id, keep| q.post_one(wr_id, op, sge, flags, keep),
        );
        match posted {
            Ok(()) => p.posted_lone(bytes),
            Err(e) => {
                self.inflight.fail(slot, e);
                self.fail_connection(t.conn, "post failed", &TransferError::Flushed);
            }
        }
        self.inflight.end_posting(slot);
        Some(p)
    }
}
