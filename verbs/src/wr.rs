//! Work requests, built into reusable batches that are posted with one doorbell.

use crate::error::{Error, Result};
use crate::mr::OwnedRegistration;
use crate::qp::QueuePairCapabilities;
use crate::sys;

pub use rixl_proto::wire::{SendFlags, SendOp, Sge};

/// The `ibv_send_flags` bits of `flags`.
fn send_flag_bits(flags: SendFlags) -> u32 {
    use sys::ibv_send_flags as f;
    (if flags.signaled {
        f::IBV_SEND_SIGNALED
    } else {
        0
    }) | (if flags.inline { f::IBV_SEND_INLINE } else { 0 })
        | (if flags.fence { f::IBV_SEND_FENCE } else { 0 })
        | (if flags.solicited {
            f::IBV_SEND_SOLICITED
        } else {
            0
        })
}

/// A reusable list of send work requests. Push requests, post with
/// [`QueuePair::post_send`](crate::QueuePair::post_send), then [`clear`](Self::clear) and reuse
/// (the vectors keep their capacity, so the hot path does not allocate).
#[derive(Default)]
pub struct SendBatch {
    wrs: Vec<sys::ibv_send_wr>,
    sges: Vec<sys::ibv_sge>,
    // (first sge, count, total bytes) per request.
    spans: Vec<(usize, usize, u64)>,
}

impl std::fmt::Debug for SendBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendBatch")
            .field("requests", &self.wrs.len())
            .field("sges", &self.sges.len())
            .finish()
    }
}

impl SendBatch {
    /// An empty batch with room for `requests` requests of `sges_per_request` entries.
    pub fn with_capacity(requests: usize, sges_per_request: usize) -> Self {
        SendBatch {
            wrs: Vec::with_capacity(requests),
            sges: Vec::with_capacity(requests * sges_per_request),
            spans: Vec::with_capacity(requests),
        }
    }

    /// Appends a request.
    pub fn push(&mut self, wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) {
        let first = self.sges.len();
        let mut total = 0u64;
        for s in sges {
            total += u64::from(s.length);
            self.sges.push(sys::ibv_sge {
                addr: s.addr,
                length: s.length,
                lkey: s.lkey,
            });
        }
        // Built in place: a request assembled on the stack and then copied into the vector read
        // its union fields back with wider loads than they were stored with (a store-forwarding
        // stall that was a third of the software path's time in the null-QP bench).
        self.wrs.push(sys::ibv_send_wr::default());
        let Some(wr) = self.wrs.last_mut() else {
            return;
        };
        fill_send(wr, wr_id, op, flags);
        self.spans.push((first, sges.len(), total));
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.wrs.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    /// Removes all requests, keeping capacity.
    pub fn clear(&mut self) {
        self.wrs.clear();
        self.sges.clear();
        self.spans.clear();
    }

    pub(crate) fn check_inside<B: OwnedRegistration>(&self, buffers: &[B]) -> Result<()> {
        sges_inside(&self.sges, buffers)
    }

    pub(crate) fn check(&self, caps: &QueuePairCapabilities, max_msg: u32) -> Result<()> {
        for (i, &(_, n, total)) in self.spans.iter().enumerate() {
            check_request(caps, max_msg, n, self.wrs[i].send_flags, total)?;
        }
        if self.wrs.len() as u64 > u64::from(caps.max_send_wr) {
            return Err(Error::Limit {
                what: "work requests per post",
                requested: self.wrs.len() as u64,
                limit: u64::from(caps.max_send_wr),
            });
        }
        Ok(())
    }

    /// Links the requests into a NULL-terminated list; returns its head.
    pub(crate) fn link(&mut self) -> Option<*mut sys::ibv_send_wr> {
        link_list(
            &mut self.wrs,
            &mut self.sges,
            self.spans.iter().map(|&(f, c, _)| (f, c)),
        )
    }

    pub(crate) fn index_of(&self, bad: *mut sys::ibv_send_wr) -> usize {
        index_in(&self.wrs, bad)
    }
}

/// Fills a zeroed send request's id, flags and operation (its entries are linked separately).
pub(crate) fn fill_send(wr: &mut sys::ibv_send_wr, wr_id: u64, op: SendOp, flags: SendFlags) {
    wr.wr_id = wr_id;
    wr.send_flags = send_flag_bits(flags);
    match op {
        SendOp::Write { remote_addr, rkey } => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
            wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
        SendOp::Read { remote_addr, rkey } => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
            wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        SendOp::Send => wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND,
        SendOp::SendWithImm { imm } => {
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
    }
}

/// Checks one send request of `n` entries and `total` bytes, with `ibv_send_flags` `flags`,
/// against the queue pair's limits.
pub(crate) fn check_request(
    caps: &QueuePairCapabilities,
    max_msg: u32,
    n: usize,
    flags: u32,
    total: u64,
) -> Result<()> {
    if n as u64 > u64::from(caps.max_send_sge) {
        return Err(Error::Limit {
            what: "scatter/gather entries per send request",
            requested: n as u64,
            limit: u64::from(caps.max_send_sge),
        });
    }
    if flags & sys::ibv_send_flags::IBV_SEND_INLINE != 0 && total > u64::from(caps.max_inline_data)
    {
        return Err(Error::Limit {
            what: "inline bytes per send request",
            requested: total,
            limit: u64::from(caps.max_inline_data),
        });
    }
    if total > u64::from(max_msg) {
        return Err(Error::Limit {
            what: "message size",
            requested: total,
            limit: u64::from(max_msg),
        });
    }
    Ok(())
}

pub(crate) fn sges_inside<B: OwnedRegistration>(
    sges: &[sys::ibv_sge],
    buffers: &[B],
) -> Result<()> {
    for (i, s) in sges.iter().enumerate() {
        let inside = buffers.iter().any(|b| {
            let r = b.memory_region();
            r.lkey() == s.lkey && r.contains(s.addr, u64::from(s.length))
        });
        if !inside {
            return Err(Error::InvalidArgument(format!(
                "scatter/gather entry {i} ({:#x}+{}, lkey {:#x}) is not inside the given buffers",
                s.addr, s.length, s.lkey
            )));
        }
    }
    Ok(())
}

/// The fields linking shared by `ibv_send_wr` and `ibv_recv_wr`.
trait Linked: Sized {
    fn set_links(&mut self, sg_list: *mut sys::ibv_sge, num_sge: i32, next: *mut Self);
}

impl Linked for sys::ibv_send_wr {
    fn set_links(&mut self, sg_list: *mut sys::ibv_sge, num_sge: i32, next: *mut Self) {
        (self.sg_list, self.num_sge, self.next) = (sg_list, num_sge, next);
    }
}

impl Linked for sys::ibv_recv_wr {
    fn set_links(&mut self, sg_list: *mut sys::ibv_sge, num_sge: i32, next: *mut Self) {
        (self.sg_list, self.num_sge, self.next) = (sg_list, num_sge, next);
    }
}

/// Points every request at its (first, count) entries and at the next request; returns the head.
fn link_list<W: Linked>(
    wrs: &mut [W],
    sges: &mut [sys::ibv_sge],
    spans: impl Iterator<Item = (usize, usize)>,
) -> Option<*mut W> {
    let n = wrs.len();
    if n == 0 {
        return None;
    }
    let sge_base = sges.as_mut_ptr();
    let wr_base = wrs.as_mut_ptr();
    for (i, (first, count)) in spans.enumerate() {
        let sg = if count == 0 {
            std::ptr::null_mut()
        } else {
            sge_base.wrapping_add(first)
        };
        let next = if i + 1 < n {
            wr_base.wrapping_add(i + 1)
        } else {
            std::ptr::null_mut()
        };
        wrs[i].set_links(sg, i32::try_from(count).unwrap_or(i32::MAX), next);
    }
    Some(wr_base)
}

/// Index of `bad` (a pointer the provider returned) in `wrs`.
fn index_in<W>(wrs: &[W], bad: *mut W) -> usize {
    (bad as usize)
        .checked_sub(wrs.as_ptr() as usize)
        .map_or(0, |d| d / std::mem::size_of::<W>())
}

/// A reusable list of receive work requests.
#[derive(Default)]
pub struct RecvBatch {
    wrs: Vec<sys::ibv_recv_wr>,
    sges: Vec<sys::ibv_sge>,
    spans: Vec<(usize, usize)>,
}

impl std::fmt::Debug for RecvBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBatch")
            .field("requests", &self.wrs.len())
            .finish()
    }
}

impl RecvBatch {
    /// Appends a receive of up to the entries' total length.
    pub fn push(&mut self, wr_id: u64, sges: &[Sge]) {
        let first = self.sges.len();
        self.sges.extend(sges.iter().map(|s| sys::ibv_sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        }));
        self.wrs.push(sys::ibv_recv_wr {
            wr_id,
            ..Default::default()
        });
        self.spans.push((first, sges.len()));
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.wrs.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    /// Removes all requests, keeping capacity.
    pub fn clear(&mut self) {
        self.wrs.clear();
        self.sges.clear();
        self.spans.clear();
    }

    pub(crate) fn check_inside<B: OwnedRegistration>(&self, buffers: &[B]) -> Result<()> {
        sges_inside(&self.sges, buffers)
    }

    pub(crate) fn check(&self, caps: &QueuePairCapabilities) -> Result<()> {
        if let Some(&(_, n)) = self
            .spans
            .iter()
            .find(|&&(_, n)| n as u64 > u64::from(caps.max_recv_sge))
        {
            return Err(Error::Limit {
                what: "scatter/gather entries per receive request",
                requested: n as u64,
                limit: u64::from(caps.max_recv_sge),
            });
        }
        Ok(())
    }

    pub(crate) fn link(&mut self) -> Option<*mut sys::ibv_recv_wr> {
        link_list(&mut self.wrs, &mut self.sges, self.spans.iter().copied())
    }

    pub(crate) fn index_of(&self, bad: *mut sys::ibv_recv_wr) -> usize {
        index_in(&self.wrs, bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps() -> QueuePairCapabilities {
        QueuePairCapabilities {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 16,
        }
    }

    fn sge(addr: u64, length: u32) -> Sge {
        Sge {
            addr,
            length,
            lkey: 7,
        }
    }

    #[test]
    fn links_requests_in_order_with_their_entries() {
        let mut b = SendBatch::default();
        b.push(1, SendOp::Send, &[sge(0x1000, 8)], SendFlags::default());
        b.push(
            2,
            SendOp::Write {
                remote_addr: 0x9000,
                rkey: 3,
            },
            &[sge(0x2000, 4), sge(0x3000, 4)],
            SendFlags::SIGNALED,
        );
        let head = b.link().expect("non-empty");
        // SAFETY: test-only walk of the list just linked; `b` is alive and unmoved.
        let (first, second) = unsafe { (&*head, &*head.add(1)) };
        assert_eq!(first.wr_id, 1);
        assert_eq!(first.next, head.wrapping_add(1));
        assert_eq!(second.next, std::ptr::null_mut());
        assert_eq!(second.num_sge, 2);
        // SAFETY: `sg_list` points into `b.sges`, two entries long.
        let s = unsafe { &*second.sg_list.add(1) };
        assert_eq!((s.addr, s.length), (0x3000, 4));
        assert_eq!(
            second.send_flags & sys::ibv_send_flags::IBV_SEND_SIGNALED,
            sys::ibv_send_flags::IBV_SEND_SIGNALED
        );
        // SAFETY: the union was written as `rdma` for a Write.
        let rdma = unsafe { second.wr.rdma };
        assert_eq!((rdma.remote_addr, rdma.rkey), (0x9000, 3));
        assert_eq!(b.index_of(head.wrapping_add(1)), 1);
    }

    #[test]
    fn enforces_sge_inline_and_message_limits() {
        let mut b = SendBatch::default();
        b.push(
            1,
            SendOp::Send,
            &[sge(0, 1), sge(1, 1), sge(2, 1)],
            SendFlags::default(),
        );
        assert!(matches!(
            b.check(&caps(), u32::MAX),
            Err(Error::Limit { requested: 3, .. })
        ));
        b.clear();
        let flags = SendFlags {
            inline: true,
            ..SendFlags::default()
        };
        b.push(1, SendOp::Send, &[sge(0, 17)], flags);
        assert!(matches!(
            b.check(&caps(), u32::MAX),
            Err(Error::Limit { requested: 17, .. })
        ));
        b.clear();
        b.push(
            1,
            SendOp::Send,
            &[sge(0, 100), sge(100, 100)],
            SendFlags::default(),
        );
        assert!(matches!(
            b.check(&caps(), 150),
            Err(Error::Limit { requested: 200, .. })
        ));
        assert!(b.check(&caps(), 200).is_ok());
    }

    #[test]
    fn immediate_data_is_big_endian_on_the_wire() {
        let mut b = SendBatch::default();
        b.push(
            9,
            SendOp::SendWithImm { imm: 0x0102_0304 },
            &[],
            SendFlags::default(),
        );
        let head = b.link().expect("non-empty");
        // SAFETY: the list was just linked; the union holds imm_data for SEND_WITH_IMM.
        let imm = unsafe { (*head).__bindgen_anon_1.imm_data };
        assert_eq!(imm, 0x0102_0304u32.to_be());
        // SAFETY: as above.
        assert!(unsafe { (*head).sg_list }.is_null());
    }
}
