//! Reliable-connected queue pairs with checked state transitions.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::context::{Gid, Mtu};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::mr::AccessFlags;
use crate::mr::{MemoryRegion, OwnedRegistration};
use crate::mw::{BoundWindow, MemoryWindow};
use crate::pd::ProtectionDomain;
use crate::sys;
use crate::wr::{check_request, fill_send, sges_inside, RecvBatch, SendBatch};
use crate::wr::{SendFlags, SendOp, Sge};

/// The state of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QueuePairState {
    /// Just created, or reset.
    Reset,
    /// Initialised: port and access set; receives may be posted.
    Init,
    /// Ready to receive: connected to the remote endpoint.
    ReadyToReceive,
    /// Ready to send.
    ReadyToSend,
    /// Error: outstanding work is flushed with `IBV_WC_WR_FLUSH_ERR`.
    Error,
}

impl QueuePairState {
    fn to_u8(self) -> u8 {
        self as u8
    }

    fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::ReadyToReceive,
            3 => Self::ReadyToSend,
            _ => Self::Error,
        }
    }

    fn to_raw(self) -> u32 {
        match self {
            Self::Reset => sys::ibv_qp_state::IBV_QPS_RESET,
            Self::Init => sys::ibv_qp_state::IBV_QPS_INIT,
            Self::ReadyToReceive => sys::ibv_qp_state::IBV_QPS_RTR,
            Self::ReadyToSend => sys::ibv_qp_state::IBV_QPS_RTS,
            Self::Error => sys::ibv_qp_state::IBV_QPS_ERR,
        }
    }
}

/// What one side must learn about the other to connect an RC queue pair. Exchange it out of
/// band (TCP, a metadata store) with [`Endpoint::to_bytes`] / [`Endpoint::from_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID (RoCE: the IPv4-mapped or IPv6 address GID).
    pub gid: Gid,
    /// Active MTU of the port.
    pub mtu: Mtu,
}

impl Endpoint {
    /// Size of the wire form.
    pub const WIRE_LEN: usize = 4 + 4 + 2 + 16 + 1;

    /// Fixed-size wire form (big endian).
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_be_bytes());
        b[4..8].copy_from_slice(&self.psn.to_be_bytes());
        b[8..10].copy_from_slice(&self.lid.to_be_bytes());
        b[10..26].copy_from_slice(&self.gid.0);
        // The MTU is encoded as its ibv_mtu value (1..=5).
        b[26] = u8::try_from(self.mtu.to_raw()).unwrap_or(3);
        b
    }

    /// Parses the wire form.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the length, the PSN or the MTU is invalid.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() != Self::WIRE_LEN {
            return Err(Error::InvalidArgument(format!(
                "endpoint is {} bytes, expected {}",
                b.len(),
                Self::WIRE_LEN
            )));
        }
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let psn = u32_at(4);
        if psn > 0x00ff_ffff {
            return Err(Error::InvalidArgument(format!(
                "PSN {psn:#x} exceeds 24 bits"
            )));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[10..26]);
        Ok(Endpoint {
            qpn: u32_at(0),
            psn,
            lid: u16::from_be_bytes([b[8], b[9]]),
            gid: Gid(gid),
            mtu: Mtu::from_raw(u32::from(b[26]))
                .ok_or_else(|| Error::InvalidArgument(format!("MTU code {}", b[26])))?,
        })
    }
}

/// Connection parameters (defaults follow perftest: timeout 14, retry 7, RNR retry 7).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ConnectOptions {
    /// Port number (from 1).
    pub port: u8,
    /// Local GID index (RoCEv2 IPv4: usually 1 on rxe).
    pub gid_index: u32,
    /// Path MTU; `None` uses the smaller of both ports' active MTUs.
    pub mtu: Option<Mtu>,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout.
    pub timeout: u8,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR`.
    pub retry_cnt: u8,
    /// RNR retries (7 = infinite).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READs as initiator and as target.
    pub max_rd_atomic: u8,
    /// Remote access granted to the peer on this QP.
    pub access: AccessFlags,
    /// GRH traffic class.
    pub traffic_class: u8,
    /// GRH hop limit.
    pub hop_limit: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            port: 1,
            gid_index: 0,
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            access: AccessFlags::ALL_RDMA,
            traffic_class: 0,
            hop_limit: 64,
        }
    }
}

/// Requested queue sizes. The device may grant more; see [`QueuePair::capabilities`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct QueuePairCapabilities {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send work request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive work request.
    pub max_recv_sge: u32,
    /// Inline data bytes per send work request.
    pub max_inline_data: u32,
}

impl Default for QueuePairCapabilities {
    fn default() -> Self {
        QueuePairCapabilities {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// A reliable-connected queue pair. Keeps its PD and CQs alive.
pub struct QueuePair {
    raw: NonNull<sys::ibv_qp>,
    qpn: u32,
    caps: QueuePairCapabilities,
    state: AtomicU8,
    max_msg_sz: std::sync::atomic::AtomicU32,
    pd: ProtectionDomain,
    _send_cq: CompletionQueue,
    _recv_cq: CompletionQueue,
}

// SAFETY: posting and modifying a QP is thread-safe in libibverbs; our state is atomic.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qpn)
            .field("state", &self.state())
            .field("caps", &self.caps)
            .finish()
    }
}

impl QueuePair {
    /// Creates an RC queue pair in the `Reset` state.
    ///
    /// # Errors
    /// [`Error::Limit`] if a requested size exceeds the device's limits; the failing verb's error variant if
    /// `ibv_create_qp` fails.
    pub fn new_rc(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QueuePairCapabilities,
    ) -> Result<Self> {
        let dev = pd.context().query_device()?;
        let check = |what, requested: u32, limit: u32| {
            if requested > limit {
                Err(Error::Limit {
                    what,
                    requested: u64::from(requested),
                    limit: u64::from(limit),
                })
            } else {
                Ok(())
            }
        };
        check("send queue depth", caps.max_send_wr, dev.max_qp_wr)?;
        check("receive queue depth", caps.max_recv_wr, dev.max_qp_wr)?;
        check(
            "send scatter/gather entries",
            caps.max_send_sge,
            dev.max_sge,
        )?;
        check(
            "receive scatter/gather entries",
            caps.max_recv_sge,
            dev.max_sge,
        )?;
        let mut attr = sys::ibv_qp_init_attr {
            send_cq: send_cq.as_raw(),
            recv_cq: recv_cq.as_raw(),
            cap: sys::ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: sys::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: PD and CQs are live and belong to the same context; `attr` is valid.
        let raw = unsafe { sys::ibv_create_qp(pd.as_raw(), &mut attr) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os(Error::CreateQp))?;
        // SAFETY: `raw` is the QP just created.
        let qpn = unsafe { (*raw.as_ptr()).qp_num };
        let granted = QueuePairCapabilities {
            max_send_wr: attr.cap.max_send_wr,
            max_recv_wr: attr.cap.max_recv_wr,
            max_send_sge: attr.cap.max_send_sge,
            max_recv_sge: attr.cap.max_recv_sge,
            max_inline_data: attr.cap.max_inline_data,
        };
        tracing::debug!(qpn, caps = ?granted, "created RC queue pair");
        Ok(QueuePair {
            raw,
            qpn,
            caps: granted,
            state: AtomicU8::new(QueuePairState::Reset.to_u8()),
            max_msg_sz: std::sync::atomic::AtomicU32::new(u32::MAX),
            pd: pd.clone(),
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
        })
    }

    /// The queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// The sizes the device granted.
    pub fn capabilities(&self) -> QueuePairCapabilities {
        self.caps
    }

    /// The state as last set through this handle (errors the NIC enters on its own show up as
    /// error completions).
    pub fn state(&self) -> QueuePairState {
        QueuePairState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Largest message the connected port carries (known after [`Self::to_rtr`]).
    pub fn max_message_size(&self) -> u32 {
        self.max_msg_sz.load(Ordering::Relaxed)
    }

    /// This side's endpoint for `opts` (port, GID index), with a PSN from `psn` (24 bits).
    ///
    /// # Errors
    /// the failing verb's error variant if the port or GID cannot be queried; [`Error::InvalidArgument`] if the GID
    /// entry is empty.
    pub fn endpoint(&self, opts: &ConnectOptions, psn: u32) -> Result<Endpoint> {
        let ctx = self.pd.context();
        let port = ctx.query_port(opts.port)?;
        let gid = ctx.query_gid(opts.port, opts.gid_index)?;
        if gid.is_zero() && port.link_layer == crate::LinkLayer::Ethernet {
            return Err(Error::InvalidArgument(format!(
                "GID index {} of {} port {} is empty",
                opts.gid_index,
                ctx.name(),
                opts.port
            )));
        }
        Ok(Endpoint {
            qpn: self.qpn,
            psn: psn & 0x00ff_ffff,
            lid: port.lid,
            gid,
            mtu: port.active_mtu,
        })
    }

    fn transition(
        &self,
        to: QueuePairState,
        allowed_from: &[QueuePairState],
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
    ) -> Result<()> {
        let from = self.state();
        if !allowed_from.contains(&from) {
            return Err(Error::InvalidTransition {
                qpn: self.qpn,
                from,
                to,
            });
        }
        attr.qp_state = to.to_raw();
        let mask = i32::try_from(mask | sys::ibv_qp_attr_mask::IBV_QP_STATE).unwrap_or(i32::MAX);
        // SAFETY: the QP is live and `attr` is a valid attribute block for `mask`.
        let rc = unsafe { sys::ibv_modify_qp(self.raw.as_ptr(), attr, mask) };
        if rc != 0 {
            return Err(Error::from_ret(Error::ModifyQp, rc));
        }
        self.state.store(to.to_u8(), Ordering::Release);
        tracing::debug!(qpn = self.qpn, ?from, ?to, "queue pair transition");
        Ok(())
    }

    /// RESET → INIT.
    ///
    /// # Errors
    /// [`Error::InvalidTransition`] out of order, the failing verb's error variant if the device refuses.
    pub fn to_init(&self, opts: &ConnectOptions) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = sys::ibv_qp_attr {
            pkey_index: 0,
            port_num: opts.port,
            qp_access_flags: opts.access.bits(),
            ..Default::default()
        };
        self.transition(
            QueuePairState::Init,
            &[QueuePairState::Reset],
            &mut attr,
            m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// INIT → RTR, connecting to `remote`.
    ///
    /// # Errors
    /// [`Error::InvalidTransition`] out of order, the failing verb's error variant if the device refuses (e.g. an
    /// unreachable GID).
    pub fn to_rtr(&self, remote: &Endpoint, opts: &ConnectOptions) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let ctx = self.pd.context();
        let port = ctx.query_port(opts.port)?;
        self.max_msg_sz.store(port.max_msg_sz, Ordering::Relaxed);
        let mtu = opts.mtu.unwrap_or(port.active_mtu.min(remote.mtu));
        let sgid_index = u8::try_from(opts.gid_index)
            .map_err(|_| Error::InvalidArgument(format!("GID index {}", opts.gid_index)))?;
        let is_global = port.link_layer == crate::LinkLayer::Ethernet || !remote.gid.is_zero();
        let mut attr = sys::ibv_qp_attr {
            path_mtu: mtu.to_raw(),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: opts.max_rd_atomic,
            min_rnr_timer: opts.min_rnr_timer,
            ah_attr: sys::ibv_ah_attr {
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                is_global: u8::from(is_global),
                port_num: opts.port,
                grh: sys::ibv_global_route {
                    dgid: sys::ibv_gid { raw: remote.gid.0 },
                    flow_label: 0,
                    sgid_index,
                    hop_limit: opts.hop_limit,
                    traffic_class: opts.traffic_class,
                },
                ..Default::default()
            },
            ..Default::default()
        };
        self.transition(
            QueuePairState::ReadyToReceive,
            &[QueuePairState::Init],
            &mut attr,
            m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
        )
    }

    /// RTR → RTS with the local PSN `psn`.
    ///
    /// # Errors
    /// [`Error::InvalidTransition`] out of order, the failing verb's error variant if the device refuses.
    pub fn to_rts(&self, psn: u32, opts: &ConnectOptions) -> Result<()> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = sys::ibv_qp_attr {
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            sq_psn: psn & 0x00ff_ffff,
            max_rd_atomic: opts.max_rd_atomic,
            ..Default::default()
        };
        self.transition(
            QueuePairState::ReadyToSend,
            &[QueuePairState::ReadyToReceive],
            &mut attr,
            m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// RESET → INIT → RTR → RTS in one call. `local_psn` must be the PSN of the endpoint this side
    /// sent to the peer.
    ///
    /// # Errors
    /// As the individual transitions.
    pub fn connect(&self, remote: &Endpoint, local_psn: u32, opts: &ConnectOptions) -> Result<()> {
        if self.state() == QueuePairState::Reset {
            self.to_init(opts)?;
        }
        self.to_rtr(remote, opts)?;
        self.to_rts(local_psn, opts)
    }

    /// Moves the QP to ERROR: every outstanding work request completes with
    /// `IBV_WC_WR_FLUSH_ERR`. Allowed from any state.
    ///
    /// # Errors
    /// the failing verb's error variant if the device refuses.
    pub fn to_error(&self) -> Result<()> {
        let mut attr = sys::ibv_qp_attr::default();
        self.transition(
            QueuePairState::Error,
            &[
                QueuePairState::Reset,
                QueuePairState::Init,
                QueuePairState::ReadyToReceive,
                QueuePairState::ReadyToSend,
                QueuePairState::Error,
            ],
            &mut attr,
            0,
        )
    }

    /// Posts a linked list of send-queue work requests with one doorbell.
    ///
    /// # Safety
    /// Every local scatter/gather entry must reference memory registered under its lkey that stays
    /// allocated, and is not accessed by the CPU in a conflicting way, until the work request
    /// completes (successfully, in error, or flushed). Remote addresses are checked by the NIC
    /// against the rkey (a violation is an error completion, not UB).
    ///
    /// # Errors
    /// [`Error::Limit`] if a request exceeds the QP's granted scatter/gather or inline limits or
    /// the port's message size (nothing is posted then); [`Error::PostSend`] with the index of the first
    /// request not posted if the provider refuses (e.g. the send queue is full).
    pub unsafe fn post_send(&self, batch: &mut SendBatch) -> Result<()> {
        batch.check(&self.caps, self.max_message_size())?;
        let Some(head) = batch.link() else {
            return Ok(());
        };
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `head` is a well-formed NULL-terminated list owned by `batch` (linked just now,
        // not moved until after the call); the caller upholds the memory contract.
        let rc = unsafe { sys::ibv_post_send(self.raw.as_ptr(), head, &mut bad) };
        if rc != 0 {
            return Err(Error::PostSend {
                index: batch.index_of(bad),
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    /// Posts a linked list of receive work requests.
    ///
    /// # Safety
    /// Every scatter/gather entry must reference memory registered (with local write) under its
    /// lkey that stays allocated and is not accessed by the CPU until the receive completes or is
    /// flushed.
    ///
    /// # Errors
    /// [`Error::Limit`] if a request has more entries than the QP allows; [`Error::PostRecv`] if the
    /// provider refuses (e.g. the receive queue is full).
    pub unsafe fn post_recv(&self, batch: &mut RecvBatch) -> Result<()> {
        batch.check(&self.caps)?;
        let Some(head) = batch.link() else {
            return Ok(());
        };
        let mut bad: *mut sys::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: `head` is a well-formed NULL-terminated list owned by `batch`; the caller
        // upholds the memory contract.
        let rc = unsafe { sys::ibv_post_recv(self.raw.as_ptr(), head, &mut bad) };
        if rc != 0 {
            return Err(Error::PostRecv {
                index: batch.index_of(bad),
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    /// Safe posting: every local entry must lie inside one of `buffers` under its lkey (checked;
    /// nothing is posted otherwise). A [`crate::RegisteredBuffer`] deregisters its region before freeing
    /// its memory, and deregistration fences the NIC, so even if a buffer is dropped before the
    /// request completes the NIC never touches freed memory: the request fails with an error
    /// completion instead. Keep buffers alive until completion to get the data moved.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first entry outside `buffers`; otherwise as
    /// [`Self::post_send`].
    pub fn post_send_in<B: OwnedRegistration>(
        &self,
        batch: &mut SendBatch,
        buffers: &[B],
    ) -> Result<()> {
        batch.check_inside(buffers)?;
        // SAFETY: every entry lies inside a live owned registration (checked above), which
        // deregisters before its memory is freed (the `OwnedRegistration` contract), so the NIC cannot reach freed memory through
        // these entries (see the method docs).
        unsafe { self.post_send(batch) }
    }

    /// Safe posting of one send request of the one entry `sge`, which must lie inside `buffer`
    /// under its lkey, with a doorbell of its own: [`Self::post_send_in`] of a batch of one,
    /// built on the stack (a lone small transfer's post, with no batch to fill and link).
    ///
    /// # Errors
    /// As [`Self::post_send_in`] (the failing request's index is 0).
    pub fn post_send_one_in<B: OwnedRegistration + ?Sized>(
        &self,
        wr_id: u64,
        op: SendOp,
        sge: Sge,
        flags: SendFlags,
        buffer: &B,
    ) -> Result<()> {
        let mut entry = sys::ibv_sge {
            addr: sge.addr,
            length: sge.length,
            lkey: sge.lkey,
        };
        sges_inside(std::slice::from_ref(&entry), std::slice::from_ref(&buffer))?;
        let mut wr = sys::ibv_send_wr::default();
        fill_send(&mut wr, wr_id, op, flags);
        check_request(
            &self.caps,
            self.max_message_size(),
            1,
            wr.send_flags,
            u64::from(sge.length),
        )?;
        wr.sg_list = &mut entry;
        wr.num_sge = 1;
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `wr` is one request (its `next` NULL) whose one entry, `entry`, lies inside
        // the live owned registration `buffer` (checked above), which deregisters before its
        // memory is freed; both live on this stack frame until the call returns, and the
        // provider copies the request into its queue during the call.
        let rc = unsafe { sys::ibv_post_send(self.raw.as_ptr(), &mut wr, &mut bad) };
        if rc != 0 {
            return Err(Error::PostSend {
                index: 0,
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    /// Safe posting of receives into `buffers` (see [`Self::post_send_in`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first entry outside `buffers`; otherwise as
    /// [`Self::post_recv`].
    pub fn post_recv_in<B: OwnedRegistration>(
        &self,
        batch: &mut RecvBatch,
        buffers: &[B],
    ) -> Result<()> {
        batch.check_inside(buffers)?;
        // SAFETY: as in `post_send_in`.
        unsafe { self.post_recv(batch) }
    }

    /// Posts a bind of `window` to `len` bytes at `addr` of `region` on this queue pair,
    /// granting `access` (of [`AccessFlags::REMOTE_READ`], [`AccessFlags::REMOTE_WRITE`],
    /// [`AccessFlags::REMOTE_ATOMIC`]) to this queue pair's peer only. Returns the rkey the
    /// peer addresses the window with; the grant holds once the bind's completion (`wr_id`,
    /// always signaled) arrives, and ends with [`Self::post_invalidate`] of that rkey or when
    /// the window is dropped.
    ///
    /// A bind that completes in error leaves the window's key out of step with the device's:
    /// drop that window and allocate another.
    ///
    /// # Safety
    /// `region` must stay registered (not dropped) while the window is bound: the peer reaches
    /// its memory through the window until the invalidation's completion arrived or the window
    /// was dropped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty range, one outside `region`, or local access
    /// flags; [`Error::PostSend`] if the provider refuses (no room in the send queue, or the
    /// region was registered without [`AccessFlags::MW_BIND`]).
    pub unsafe fn post_bind_window(
        &self,
        window: &mut MemoryWindow,
        region: &MemoryRegion,
        addr: u64,
        len: u64,
        access: AccessFlags,
        wr_id: u64,
    ) -> Result<u32> {
        let remote =
            AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        let inside = addr >= region.addr()
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= region.addr() + region.len() as u64);
        if len == 0 || !inside || !remote.contains(access) {
            return Err(Error::InvalidArgument(format!(
                "window bind of {len} bytes at {addr:#x} with {access:?}: the range must be \
                 non-empty and inside the region, the access remote only"
            )));
        }
        let rkey = window.next_rkey();
        let mut wr = sys::ibv_send_wr {
            wr_id,
            opcode: sys::ibv_wr_opcode::IBV_WR_BIND_MW,
            send_flags: sys::ibv_send_flags::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        wr.__bindgen_anon_2.bind_mw = sys::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
            mw: window.as_raw(),
            rkey,
            bind_info: sys::ibv_mw_bind_info {
                mr: region.as_raw(),
                addr,
                length: len,
                mw_access_flags: access.bits(),
            },
        };
        // Posted naming the window by its current key; the new one is its key from now on.
        self.post_one(&mut wr)?;
        window.set_rkey(rkey);
        Ok(rkey)
    }

    /// Posts a bind of `window` to `len` bytes at `addr` of the registration `region(&keep)`
    /// on this queue pair (as [`Self::post_bind_window`]), and returns the bound window owning
    /// `keep`: the registration cannot be dropped while the window is bound, so this is safe.
    /// The grant holds once the bind's completion (`wr_id`) arrives; dropping the result
    /// revokes it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `region(&keep)` is `None` (memory without a registration),
    /// else as [`Self::post_bind_window`].
    #[allow(clippy::too_many_arguments)]
    pub fn bind_window<K>(
        self: &std::sync::Arc<Self>,
        mut window: MemoryWindow,
        keep: K,
        region: fn(&K) -> Option<&dyn OwnedRegistration>,
        addr: u64,
        len: u64,
        access: AccessFlags,
        wr_id: u64,
    ) -> Result<BoundWindow<K>> {
        let Some(reg) = region(&keep) else {
            return Err(Error::InvalidArgument(
                "a window needs registered memory".into(),
            ));
        };
        // SAFETY: the registration is borrowed from `keep`, which the bound window owns (and
        // never lends mutably) until after the window is deallocated: it stays registered
        // while the window is bound.
        let rkey = unsafe {
            self.post_bind_window(&mut window, reg.memory_region(), addr, len, access, wr_id)?
        };
        Ok(BoundWindow::new(
            window,
            rkey,
            std::sync::Arc::clone(self),
            keep,
        ))
    }

    /// Posts a local invalidation of `rkey`, the key of a window bound on this queue pair:
    /// once its completion (`wr_id`, always signaled) arrives, the key grants nothing.
    ///
    /// # Errors
    /// [`Error::PostSend`] if the provider refuses.
    pub fn post_invalidate(&self, rkey: u32, wr_id: u64) -> Result<()> {
        let mut wr = sys::ibv_send_wr {
            wr_id,
            opcode: sys::ibv_wr_opcode::IBV_WR_LOCAL_INV,
            send_flags: sys::ibv_send_flags::IBV_SEND_SIGNALED,
            ..Default::default()
        };
        wr.__bindgen_anon_1.invalidate_rkey = rkey;
        self.post_one(&mut wr)
    }

    /// Posts one request that references no local memory.
    fn post_one(&self, wr: &mut sys::ibv_send_wr) -> Result<()> {
        let mut bad: *mut sys::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: `wr` is one well-formed request (its `next` is null) with no scatter/gather
        // entries, alive for the call.
        let rc = unsafe { sys::ibv_post_send(self.raw.as_ptr(), wr, &mut bad) };
        if rc != 0 {
            return Err(Error::PostSend {
                index: 0,
                source: std::io::Error::from_raw_os_error(rc.abs()),
            });
        }
        Ok(())
    }

    /// The raw `ibv_qp`.
    pub fn as_raw(&self) -> *mut sys::ibv_qp {
        self.raw.as_ptr()
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: the QP is destroyed exactly once; its PD and CQs are kept alive by our fields
        // until after this runs.
        let rc = unsafe { sys::ibv_destroy_qp(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(qpn = self.qpn, rc, "ibv_destroy_qp failed");
        }
    }
}
