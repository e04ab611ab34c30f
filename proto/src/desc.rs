//! Descriptors as the core sees them: local pieces by region index, remote pieces by address and
//! key, and the direction of a transfer.

/// One local descriptor: `len` bytes at `offset` of region number `region` of its list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalDesc {
    /// Index into the list's regions.
    pub region: u32,
    /// Offset into the region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One remote descriptor: `len` bytes at the peer's `addr`, accessible under `rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteDesc {
    /// Remote start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// A list of remote descriptors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RemoteDescList(pub Vec<RemoteDesc>);

impl RemoteDescList {
    /// Sum of the lengths (saturating).
    pub fn total_len(&self) -> u64 {
        self.0.iter().fold(0u64, |a, d| a.saturating_add(d.len))
    }
}

impl FromIterator<RemoteDesc> for RemoteDescList {
    fn from_iter<I: IntoIterator<Item = RemoteDesc>>(iter: I) -> Self {
        RemoteDescList(iter.into_iter().collect())
    }
}

/// Direction of a one-sided transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// Local → remote (RDMA WRITE).
    Write,
    /// Remote → local (RDMA READ).
    Read,
}

/// A position in a descriptor list: the descriptor and how far into it. Walks that pair a local
/// and a remote list piece by piece (planning, striping, device copies) keep one per list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    /// The descriptor.
    pub index: usize,
    /// Bytes of it already passed.
    pub offset: u64,
}

impl Cursor {
    /// Moves `n` bytes on in the current descriptor, of `len` bytes; at its end, to the start of
    /// the next one.
    pub fn advance(&mut self, n: u64, len: u64) {
        self.offset += n;
        if self.offset >= len {
            self.index += 1;
            self.offset = 0;
        }
    }
}

/// Where a local region lives, as the planner needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Start address.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
    /// Whether the CPU can read it (host memory). Only such memory is posted inline
    /// (`IBV_SEND_INLINE`: the CPU copies the bytes into the request inside the post); GPU
    /// memory is read by the NIC only.
    pub host: bool,
}
