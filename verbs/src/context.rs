//! An opened device: attributes, ports, GIDs.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys;

pub(crate) struct ContextInner {
    pub(crate) raw: NonNull<sys::ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts are thread-safe; all verbs on them may be called from any thread.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every child (PD, CQ, channel) holds an `Arc` to this inner value, so all of them
        // have been destroyed before the context is closed, exactly once.
        let rc = unsafe { sys::ibv_close_device(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(device = %self.name, rc, "ibv_close_device failed");
        }
    }
}

/// An opened RDMA device (`ibv_context`). Cheap to clone; children keep it alive.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.name)
            .finish()
    }
}

/// Attributes of a device that bound what the data path may post (`ibv_query_device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttributes {
    /// Largest registrable memory region.
    pub max_mr_size: u64,
    /// Maximum work requests per queue.
    pub max_qp_wr: u32,
    /// Maximum scatter/gather entries per send/recv work request.
    pub max_sge: u32,
    /// Maximum scatter/gather entries per RDMA READ.
    pub max_sge_rd: u32,
    /// Maximum completion queue entries.
    pub max_cqe: u32,
    /// Maximum outstanding RDMA READs/atomics as target.
    pub max_qp_rd_atom: u32,
    /// Maximum outstanding RDMA READs/atomics as initiator.
    pub max_qp_init_rd_atom: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Node GUID (host order).
    pub node_guid: u64,
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkLayer {
    /// InfiniBand (LID-routed).
    InfiniBand,
    /// Ethernet (RoCE, GID-routed).
    Ethernet,
    /// Reported as unspecified.
    Unspecified,
}

/// Path MTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    pub(crate) fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            sys::ibv_mtu::IBV_MTU_256 => Mtu::Mtu256,
            sys::ibv_mtu::IBV_MTU_512 => Mtu::Mtu512,
            sys::ibv_mtu::IBV_MTU_1024 => Mtu::Mtu1024,
            sys::ibv_mtu::IBV_MTU_2048 => Mtu::Mtu2048,
            sys::ibv_mtu::IBV_MTU_4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    pub(crate) fn to_raw(self) -> u32 {
        match self {
            Mtu::Mtu256 => sys::ibv_mtu::IBV_MTU_256,
            Mtu::Mtu512 => sys::ibv_mtu::IBV_MTU_512,
            Mtu::Mtu1024 => sys::ibv_mtu::IBV_MTU_1024,
            Mtu::Mtu2048 => sys::ibv_mtu::IBV_MTU_2048,
            Mtu::Mtu4096 => sys::ibv_mtu::IBV_MTU_4096,
        }
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        256 << (self.to_raw() - 1)
    }
}

/// Attributes of one port (`ibv_query_port`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct PortAttributes {
    /// Whether the port is `IBV_PORT_ACTIVE`.
    pub active: bool,
    /// Active path MTU.
    pub active_mtu: Mtu,
    /// Largest message the port can carry.
    pub max_msg_sz: u32,
    /// Local identifier (InfiniBand).
    pub lid: u16,
    /// Number of GID table entries.
    pub gid_tbl_len: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
}

/// A 128-bit global identifier (IPv6 format; RoCEv2 IPv4 GIDs are IPv4-mapped).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether all bytes are zero (an unpopulated table entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        std::net::Ipv6Addr::from(self.0).fmt(f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

impl Context {
    pub(crate) fn from_raw_owned(raw: NonNull<sys::ibv_context>, name: String) -> Self {
        Context {
            inner: Arc::new(ContextInner { raw, name }),
        }
    }

    /// Opens a device by name, or the first device when `name` is `None`.
    ///
    /// # Errors
    /// [`Error::NoDevice`], [`Error::DeviceNotFound`] or the failing verb's error variant.
    pub fn open(name: Option<&str>) -> Result<Self> {
        let list = crate::DeviceList::new()?;
        let dev = list.find(name)?;
        dev.open()
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The raw `ibv_context`.
    pub fn as_raw(&self) -> *mut sys::ibv_context {
        self.inner.raw.as_ptr()
    }

    /// Queries the device limits.
    ///
    /// # Errors
    /// the failing verb's error variant if `ibv_query_device` fails.
    pub fn query_device(&self) -> Result<DeviceAttributes> {
        let mut attr = sys::ibv_device_attr::default();
        // SAFETY: the context is open and `attr` is a valid out-parameter.
        let rc = unsafe { sys::ibv_query_device(self.as_raw(), &mut attr) };
        if rc != 0 {
            return Err(Error::from_ret(Error::QueryDevice, rc));
        }
        let u = |v: i32| u32::try_from(v).unwrap_or(0);
        Ok(DeviceAttributes {
            max_mr_size: attr.max_mr_size,
            max_qp_wr: u(attr.max_qp_wr),
            max_sge: u(attr.max_sge),
            max_sge_rd: u(attr.max_sge_rd),
            max_cqe: u(attr.max_cqe),
            max_qp_rd_atom: u(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: u(attr.max_qp_init_rd_atom),
            phys_port_cnt: attr.phys_port_cnt,
            node_guid: u64::from_be(attr.node_guid),
        })
    }

    /// Queries a port (ports are numbered from 1).
    ///
    /// # Errors
    /// the failing verb's error variant if `ibv_query_port` fails (e.g. no such port).
    pub fn query_port(&self, port: u8) -> Result<PortAttributes> {
        let mut attr = sys::ibv_port_attr::default();
        // SAFETY: the context is open and `attr` is a valid out-parameter.
        let rc = unsafe { sys::___ibv_query_port(self.as_raw(), port, &mut attr) };
        if rc != 0 {
            return Err(Error::from_ret(Error::QueryPort, rc));
        }
        Ok(PortAttributes {
            active: attr.state == sys::ibv_port_state::IBV_PORT_ACTIVE,
            active_mtu: Mtu::from_raw(attr.active_mtu).unwrap_or(Mtu::Mtu1024),
            max_msg_sz: attr.max_msg_sz,
            lid: attr.lid,
            gid_tbl_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
            // IBV_LINK_LAYER_INFINIBAND = 1, IBV_LINK_LAYER_ETHERNET = 2 (an anonymous enum in
            // verbs.h, so bindgen gives it no stable name).
            link_layer: match attr.link_layer {
                1 => LinkLayer::InfiniBand,
                2 => LinkLayer::Ethernet,
                _ => LinkLayer::Unspecified,
            },
        })
    }

    /// Reads one GID table entry.
    ///
    /// # Errors
    /// the failing verb's error variant if `ibv_query_gid` fails (index out of range).
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let idx = i32::try_from(index)
            .map_err(|_| Error::InvalidArgument(format!("GID index {index}")))?;
        let mut gid = sys::ibv_gid::default();
        // SAFETY: the context is open and `gid` is a valid out-parameter.
        let rc = unsafe { sys::ibv_query_gid(self.as_raw(), port, idx, &mut gid) };
        if rc != 0 {
            return Err(Error::from_ret(Error::QueryGid, rc));
        }
        // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
        Ok(Gid(unsafe { gid.raw }))
    }
}
